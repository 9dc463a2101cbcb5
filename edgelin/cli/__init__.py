"""The ``edgelin`` command line: a thin layer over the library, one library function per command, one module per
command group (export, check, demo, generate, web, bench; what they share in ``common``). The library never
imports this package.

Errors a user can fix (``EdgelinError``) print one line, ``edgelin: error: ...``, and exit with status 2.
torch is imported lazily, inside the commands that need it: ``import edgelin.cli`` works on a device without it.
"""

from __future__ import annotations

import click

from edgelin import __version__
from edgelin.cli.common import OneLineGroup


@click.group(cls=OneLineGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="edgelin")
def main() -> None:
    """Deploy linear-attention language models with ONNX.

    \b
    A typical session:
      edgelin export CHECKPOINT -o out/      # two ONNX graphs (prefill + decode) + edgelin.json
      edgelin generate out/ --prompt "Hi"    # stream tokens from ONNX Runtime

    Every command has --help.
    """


from edgelin.cli.bench import bench  # noqa: E402
from edgelin.cli.check import check_cmd, validate_cmd  # noqa: E402
from edgelin.cli.demo import demo_cmd  # noqa: E402
from edgelin.cli.export import export_cmd, models_cmd  # noqa: E402
from edgelin.cli.generate import generate  # noqa: E402
from edgelin.cli.web import web  # noqa: E402

for _command in (export_cmd, models_cmd, validate_cmd, check_cmd, demo_cmd, generate, bench, web):
    main.add_command(_command)


if __name__ == "__main__":  # pragma: no cover
    main()
