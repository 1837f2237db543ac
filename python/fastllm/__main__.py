"""``python -m fastllm``: the ``fastllm`` command line."""

from fastllm.cli import main

main()
