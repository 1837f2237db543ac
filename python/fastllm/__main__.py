"""``python -m fastllm``: the ``fastllm`` command line."""

from fastllm.entrypoints.cli import main

main()
