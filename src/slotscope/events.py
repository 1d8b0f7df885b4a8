"""Event kinds: what one recognised llama-server line says (int8 codes in the events table).

Value columns by kind (``v1``..``v4``):

========== ================ ================= ========= =======
kind       v1               v2                v3        v4
========== ================ ================= ========= =======
launch     is_child
progress   n_tokens         progress          t (s)     tok/s
heartbeat  n_gen            tg                tg_3s
prompt_eval ms              tokens
eval       ms               tokens (n_gen)
total      ms               tokens
release    n_tokens         truncated
config     n_slots          n_ctx_slot
========== ================ ================= ========= =======

Two kinds carry text instead (the events' ``text``): ``model``, the model file as the server
was given it (``load_model: loading model '...'``), and ``build``, its build number and commit
(``common_params_print_info: build N (commit)``, printed at verbosity 4).
"""

LAUNCH, PROGRESS, HEARTBEAT, PROMPT_EVAL, EVAL, TOTAL, RELEASE = 1, 2, 3, 4, 5, 6, 7
TIMING_HEADER, INIT, CONFIG, CANCEL, EXIT, ERROR = 8, 9, 10, 11, 12, 13
MODEL, BUILD = 14, 15
