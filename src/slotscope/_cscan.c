/* The scanner's fast path in C: llama-server's own line layout, one line at a time.
 *
 * slotscope.scanner reads a block of lines column-wise with numpy; most of its time goes to
 * the lines that have llama-server's printf layout (a slot line's head at fixed places, and
 * the heartbeat, progress and timing messages at fixed widths). This module reads those lines
 * and only those, exactly as scanner._laid_out_heads and scanner._messages do (same checks,
 * same arithmetic, so the same float64 values). Whatever it does not read the same way for
 * certain it leaves to the numpy code: a line whose head is not laid out (state 0), or whose
 * message it does not settle (state 2: the head is read, the message is numpy's). The tests
 * hold the readings with and without this module equal, and both equal to FAST_PATTERN's.
 *
 * Optional: slotscope works the same without it (pure numpy), only slower.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <math.h>

/* Event kinds (slotscope.events). */
enum { LAUNCH = 1, PROGRESS = 2, HEARTBEAT = 3, PROMPT_EVAL = 4, EVAL = 5, TOTAL = 6, RELEASE = 7, TIMING_HEADER = 8 };

/* A window of a line's bytes, copied out of the block and zero-padded past the block's end,
 * as numpy reads them (the block's zero padding). Every read below stays inside the window:
 * the head reads at most 64 bytes from the line's start, a message at most 152 from its own. */
#define HEAD_WINDOW 80
#define MESSAGE_WINDOW 192
typedef struct {
    const uint8_t *d;
    Py_ssize_t n;
} Block;

static inline uint8_t at(const Block *b, Py_ssize_t i) { return b->d[i]; }

/* The window from ``from``: the block's own bytes where it has them all, else a copy. */
static const uint8_t *window(uint8_t *copy, Py_ssize_t size, const uint8_t *data, Py_ssize_t n, Py_ssize_t from) {
    if (from + size <= n) return data + from;
    Py_ssize_t k = n - from > 0 ? n - from : 0;
    memcpy(copy, data + from, (size_t)k);
    memset(copy + k, 0, (size_t)(size - k));
    return copy;
}
static inline int is_digit(uint8_t c) { return c >= '0' && c <= '9'; }

/* Whether the literal ``text`` is at i (a constant length: the compiler inlines the compare). */
#define has(b, i, text) (memcmp((b)->d + (i), (text), sizeof(text) - 1) == 0)

static const int64_t POW10[17] = {1LL, 10LL, 100LL, 1000LL, 10000LL, 100000LL, 1000000LL, 10000000LL,
                                   100000000LL, 1000000000LL, 10000000000LL, 100000000000LL, 1000000000000LL,
                                   10000000000000LL, 100000000000000LL, 1000000000000000LL, 10000000000000000LL};

/* scanner._right_aligned: ``width`` bytes of blanks then at least one digit, to the field's end. */
static int right_aligned(const Block *b, Py_ssize_t i, int width, int64_t *value) {
    int k = 0;
    while (k < width && at(b, i + k) == ' ') k++;
    if (k == width) return 0;
    int64_t v = 0;
    for (; k < width; k++) {
        uint8_t c = at(b, i + k);
        if (!is_digit(c)) return 0;
        v = v * 10 + (c - '0');
    }
    *value = v;
    return 1;
}

/* A printf layout (scanner._Layout): text, "%Nd" and "%N.2f" fields (N.2f: N-3 whole digits),
 * taken apart once into pieces. */
enum { TEXT, INT, CENTS };
typedef struct {
    int type, width, len;
    const char *text;
} Piece;
typedef struct {
    Piece pieces[16];
    int n, size;
} Layout;

static void compile_layout(Layout *l, const char *tmpl) {
    l->n = 0;
    l->size = 0;
    for (const char *t = tmpl; *t;) {
        Piece *pc = &l->pieces[l->n++];
        if (*t != '%') {
            pc->type = TEXT;
            pc->text = t;
            pc->len = 0;
            while (t[pc->len] && t[pc->len] != '%') pc->len++;
            t += pc->len;
            l->size += pc->len;
            continue;
        }
        int width = 0;
        for (t++; *t >= '0' && *t <= '9'; t++) width = width * 10 + (*t - '0');
        if (*t == 'd') {
            pc->type = INT, pc->width = width, pc->len = width;
            t++;
        } else { /* ".2f" */
            pc->type = CENTS, pc->width = width - 3, pc->len = width;
            t += 3;
        }
        l->size += pc->len;
    }
}

static int layout_read(const Block *b, Py_ssize_t p, const Layout *l, double *vals) {
    const uint8_t *d = b->d + p;
    int nv = 0;
    for (int j = 0; j < l->n; j++) {
        const Piece *pc = &l->pieces[j];
        int64_t v;
        if (pc->type == TEXT) {
            if (memcmp(d, pc->text, pc->len) != 0) return 0;
        } else if (pc->type == INT) {
            if (!right_aligned(b, d - b->d, pc->width, &v)) return 0;
            vals[nv++] = (double)v;
        } else {
            int w = pc->width;
            if (!right_aligned(b, d - b->d, w, &v) || d[w] != '.' || !is_digit(d[w + 1]) || !is_digit(d[w + 2])) return 0;
            vals[nv++] = (double)(v * 100 + (d[w + 1] - '0') * 10 + (d[w + 2] - '0')) / 100.0;
        }
        d += pc->len;
    }
    return 1;
}

static Layout HEARTBEAT_L, PROGRESS_L, PROMPT_EVAL_L, EVAL_L, TOTAL_L;

/* _Cursor.field(blanks=0[, frac=True]) where it is plain: blanks, 1+ digits[, "." digits], at
 * most 15 digits in all (numpy reads the same value there). Returns the position after it, or
 * -1 where this is not that case (then numpy reads the line). */
static Py_ssize_t plain_number(const Block *b, Py_ssize_t i, int frac, double *value) {
    int k = 0;
    while (at(b, i + k) == ' ') {
        if (++k >= 16) return -1;
    }
    i += k;
    int n1 = 0;
    int64_t whole = 0;
    while (is_digit(at(b, i + n1))) {
        if (n1 >= 15) return -1;
        whole = whole * 10 + (at(b, i + n1) - '0');
        n1++;
    }
    if (n1 == 0) return -1;
    i += n1;
    if (!frac) {
        *value = (double)whole;
        return i;
    }
    int n2 = 0;
    int64_t part = 0;
    if (at(b, i) == '.') {
        i++;
        while (is_digit(at(b, i + n2))) {
            if (n1 + n2 >= 15) return -1;
            part = part * 10 + (at(b, i + n2) - '0');
            n2++;
        }
        i += n2;
    }
    *value = (double)(whole * POW10[n2] + part) / (double)POW10[n2];
    return i;
}

typedef struct {
    Py_buffer raw, s, e, ts, slot, task, known, kind, v[4], state, m;
} Bufs;

/* One laid-out slot line's head (scanner._laid_out_heads); 0 if it is not one. */
static int head(const Block *b, Py_ssize_t s, Py_ssize_t e, int64_t *ts, double *slot, double *task, Py_ssize_t *m) {
    int nd = 0;
    int64_t minutes = 0;
    while (nd < 8 && is_digit(at(b, s + nd))) minutes = minutes * 10 + (at(b, s + nd++) - '0');
    if (nd < 1 || nd > 7) return 0;
    Py_ssize_t q = s + nd;
    /* ".SS.mmm.uuu L slot " */
    static const int dig[] = {1, 2, 4, 5, 6, 8, 9, 10};
    if (at(b, q) != '.' || at(b, q + 3) != '.' || at(b, q + 7) != '.') return 0;
    int64_t within = 0;
    for (int k = 0; k < 8; k++) {
        uint8_t c = at(b, q + dig[k]);
        if (!is_digit(c)) return 0;
        within = within * 10 + (c - '0');
    }
    uint8_t lv = at(b, q + 12);
    if (at(b, q + 11) != ' ' || at(b, q + 13) != ' ' || at(b, q + 14) != 's' || at(b, q + 15) != 'l') return 0;
    if (lv != 'I' && lv != 'W' && lv != 'E' && lv != 'D') return 0;
    if (!has(b, q + 16, "ot ")) return 0;
    uint64_t hi[2];
    memcpy(hi, b->d + q + 16, 16);
    if ((hi[0] | hi[1]) & 0x8080808080808080ULL) return 0;  /* the function's bytes: ASCII */
    if (at(b, q + 31) != ':' || !has(b, q + 32, " id ") || !has(b, q + 38, " |")) return 0;
    int64_t sl;
    if (!right_aligned(b, q + 36, 2, &sl)) return 0;
    if (!has(b, q + 40, " task ")) return 0;
    /* the task id: "-"? and 1-8 bytes of it in all, then " |" */
    Py_ssize_t p = q + 46;
    int neg = at(b, p) == '-';
    int nt = 0;
    int64_t t = 0;
    while (nt < 8 - neg && is_digit(at(b, p + neg + nt))) t = t * 10 + (at(b, p + neg + nt++) - '0');
    if (nt < 1) return 0;
    int size = neg + nt;
    if (at(b, p + size) != ' ' || at(b, p + size + 1) != '|') return 0;
    if (q + 48 + size > e) return 0;
    *ts = minutes * 60000000LL + within;
    *slot = (double)sl;
    *task = neg ? -(double)t : (double)t;
    *m = q + 48 + size;
    return 1;
}


/* One laid-out line's message (scanner._messages); 1 if settled here, 0 to leave it to numpy. */
static int message(const Block *b, Py_ssize_t m, Py_ssize_t e, int8_t *kind, uint8_t *known, double *v) {
    int k = 0;
    while (k < 16 && at(b, m + k) == ' ') k++;
    if (e == m || (e == m + 1 && k == 1)) {
        *kind = TIMING_HEADER;
        *known = 1;
        return 1;
    }
    Py_ssize_t p = m + k;
    int keywordish = has(b, p, "promp") || has(b, p, "eval ") || has(b, p, "total") || has(b, p, "n_gen") ||
                     has(b, p, "n_dec") || has(b, p, "stop ") || has(b, p, "proce");
    if (!keywordish) {
        if (k >= 1 && k < 16) {  /* another message of a slot: known, no event */
            *known = 1;
            return 1;
        }
        return 0;
    }
    if (k < 1 || k >= 16) return 0;
    double vals[4];
    if (k == 1 && has(b, p, "n_gen")) {
        if (!layout_read(b, p, &HEARTBEAT_L, vals)) return 0;
        *kind = HEARTBEAT;
        v[0] = vals[0], v[1] = vals[1], v[2] = vals[2];
    } else if (k == 1 && has(b, p, "prompt p")) {
        if (!layout_read(b, p, &PROGRESS_L, vals)) return 0;
        Py_ssize_t i = plain_number(b, p + PROGRESS_L.size, 1, &vals[3]);
        if (i < 0 || !has(b, i, " tokens per second")) return 0;
        *kind = PROGRESS;
        v[0] = vals[0], v[1] = vals[1], v[2] = vals[2], v[3] = vals[3];
    } else if (k == 1 && has(b, p, "prompt e")) {
        if (!layout_read(b, p, &PROMPT_EVAL_L, vals)) return 0;
        *kind = PROMPT_EVAL;
        v[0] = vals[0], v[1] = vals[1];
    } else if (has(b, p, "eval ")) {
        if (!layout_read(b, p, &EVAL_L, vals)) return 0;
        *kind = EVAL;
        v[0] = vals[0], v[1] = vals[1];
    } else if (has(b, p, "total")) {
        if (!layout_read(b, p, &TOTAL_L, vals)) return 0;
        *kind = TOTAL;
        v[0] = vals[0], v[1] = vals[1];
    } else if (k == 1 && has(b, p, "proce")) {
        if (!has(b, p, "processing task")) return 0;
        Py_ssize_t i = p + 15;
        double child = NAN;
        if (has(b, i, ", is_child = ")) {
            int nd = 0;
            int64_t c = 0;
            while (nd < 16 && is_digit(at(b, i + 13 + nd))) c = c * 10 + (at(b, i + 13 + nd++) - '0');
            if (nd > 15) return 0;
            if (nd >= 1) child = (double)c;
        }
        *kind = LAUNCH;
        v[0] = child;
    } else if (k == 1 && has(b, p, "stop ")) {
        Py_ssize_t i;
        if (has(b, p, "stop processing: n_tokens ="))
            i = p + 27;
        else if (has(b, p, "stop processing: n_past ="))
            i = p + 25;
        else
            return 0;
        i = plain_number(b, i, 0, &vals[0]);
        if (i < 0 || !has(b, i, ", truncated =")) return 0;
        if (plain_number(b, i + 13, 0, &vals[1]) < 0) return 0;
        *kind = RELEASE;
        v[0] = vals[0], v[1] = vals[1];
    } else {
        return 0;
    }
    *known = 1;
    return 1;
}

static PyObject *laid_out(PyObject *self, PyObject *args) {
    Bufs a;
    memset(&a, 0, sizeof a);
    if (!PyArg_ParseTuple(args, "y*y*y*w*w*w*w*w*w*w*w*w*w*w*", &a.raw, &a.s, &a.e, &a.ts, &a.slot, &a.task, &a.known,
                          &a.kind, &a.v[0], &a.v[1], &a.v[2], &a.v[3], &a.state, &a.m))
        return NULL;
    Py_buffer *all[] = {&a.raw, &a.s, &a.e, &a.ts, &a.slot, &a.task, &a.known, &a.kind, &a.v[0], &a.v[1], &a.v[2],
                        &a.v[3], &a.state, &a.m};
    Py_ssize_t n = a.s.len / (Py_ssize_t)sizeof(int64_t);
    int sizes_ok = a.e.len == a.s.len && a.ts.len == a.s.len && a.m.len == a.s.len && a.slot.len == n * 8 &&
                   a.task.len == n * 8 && a.known.len == n && a.kind.len == n && a.state.len == n;
    for (int j = 0; j < 4; j++) sizes_ok = sizes_ok && a.v[j].len == n * 8;
    if (!sizes_ok) {
        for (int j = 0; j < 14; j++) PyBuffer_Release(all[j]);
        PyErr_SetString(PyExc_ValueError, "laid_out: arrays of different lengths");
        return NULL;
    }
    const uint8_t *data = a.raw.buf;
    Py_ssize_t size = a.raw.len;
    const int64_t *s = a.s.buf, *e = a.e.buf;
    int64_t *ts = a.ts.buf, *m = a.m.buf;
    double *slot = a.slot.buf, *task = a.task.buf;
    uint8_t *known = a.known.buf;
    int8_t *kind = a.kind.buf, *state = a.state.buf;
    double *v[4] = {a.v[0].buf, a.v[1].buf, a.v[2].buf, a.v[3].buf};
    Py_BEGIN_ALLOW_THREADS
    uint8_t hw[HEAD_WINDOW], mw[MESSAGE_WINDOW];
    Block hb = {hw, HEAD_WINDOW}, mb = {mw, MESSAGE_WINDOW};
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t mi;
        hb.d = window(hw, HEAD_WINDOW, data, size, s[i]);
        if (!head(&hb, 0, e[i] - s[i], &ts[i], &slot[i], &task[i], &mi)) {
            state[i] = 0;
            continue;
        }
        m[i] = s[i] + mi;
        double vals[4] = {NAN, NAN, NAN, NAN};
        int8_t k = 0;
        uint8_t kn = 0;
        mb.d = window(mw, MESSAGE_WINDOW, data, size, m[i]);
        if (message(&mb, 0, e[i] - m[i], &k, &kn, vals)) {
            state[i] = 1;
            known[i] = kn;
            kind[i] = k;
            for (int j = 0; j < 4; j++) v[j][i] = vals[j];  /* NaN where the kind has no such value */
        } else {
            state[i] = 2;
        }
    }
    Py_END_ALLOW_THREADS
    for (int j = 0; j < 14; j++) PyBuffer_Release(all[j]);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"laid_out", laid_out, METH_VARARGS,
     "laid_out(raw, s, e, ts, slot, task, known, kind, v1, v2, v3, v4, state, m): read the lines with "
     "llama-server's own layout (see the module's source)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cscan", NULL, -1, methods};

PyMODINIT_FUNC PyInit__cscan(void) {
    /* The templates of scanner._HEARTBEAT, _PROGRESS, _PROMPT_EVAL, _EVAL and _TOTAL. */
    compile_layout(&HEARTBEAT_L, "n_gen = %6d, tg = %6.2f t/s, tg_3s = %6.2f t/s");
    compile_layout(&PROGRESS_L, "prompt processing, n_tokens = %6d, progress = %4.2f, t = %6.2f s /");
    compile_layout(&PROMPT_EVAL_L, "prompt eval time = %10.2f ms / %5d tokens");
    compile_layout(&EVAL_L, "eval time = %10.2f ms / %5d tokens");
    compile_layout(&TOTAL_L, "total time = %10.2f ms / %5d tokens");
    return PyModule_Create(&module);
}
