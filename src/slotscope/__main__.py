"""``python -m slotscope`` runs the CLI."""

from .cli import main

main()
