"""The bench's internal worker processes (use ``edgelin bench``):

    python -m edgelin.bench --worker SPEC_JSON   one prefill case; prints its result as JSON (torch-free)
    python -m edgelin.bench --export JOBS_JSON   export a list of graphs (torch)
    python -m edgelin.bench --foreign SPEC_JSON  the fla section (torch, fla under Triton's interpreter)
    python -m edgelin.bench --hf-build SPEC_JSON a Hugging Face checkpoint (checkpoints.py) (transformers, triton and fla hidden)
    python -m edgelin.bench --llama-greedy SPEC_JSON  the llamacpp section's greedy ids of a GGUF (llama.cpp's ctypes bindings)
    python -m edgelin.bench --hf-eager SPEC_JSON  the transformers section's measurements of one model (transformers + runtime)
    python -m edgelin.bench --genai-round SPEC_JSON  the genai section's measurement of one edgelin export (torch-free)
    python -m edgelin.bench --export-checked SPEC_JSON  the genai section's export of a checkpoint (torch)
"""

from __future__ import annotations

import json
import sys

from edgelin.bench.measure import worker_main  # torch-free

USAGE = ("usage: python -m edgelin.bench --worker SPEC_JSON | --export JOBS_JSON | --foreign SPEC_JSON | --hf-build SPEC_JSON | "
         "--llama-greedy SPEC_JSON | --hf-eager SPEC_JSON | --genai-round SPEC_JSON | --export-checked SPEC_JSON (internal; use `edgelin bench`)")


def main(argv: list[str]) -> None:
    if len(argv) == 2 and argv[0] == "--worker":
        print(json.dumps(worker_main(json.loads(argv[1]))))
    elif len(argv) == 2 and argv[0] == "--export":
        # imported here, not at the top: the --worker branch must never import torch (its memory is measured)
        from edgelin.bench.baselines import export_worker_main

        export_worker_main(argv[1])
    elif len(argv) == 2 and argv[0] == "--foreign":
        from edgelin.bench.foreign import foreign_worker_main

        foreign_worker_main(json.loads(argv[1]))
    elif len(argv) == 2 and argv[0] == "--hf-build":
        from edgelin.bench.checkpoints import hf_build_main

        hf_build_main(json.loads(argv[1]))
    elif len(argv) == 2 and argv[0] == "--llama-greedy":
        from edgelin.bench.llamacpp import llama_greedy_main

        llama_greedy_main(json.loads(argv[1]))
    elif len(argv) == 2 and argv[0] == "--hf-eager":
        from edgelin.bench.transformers_eager import hf_eager_main

        hf_eager_main(json.loads(argv[1]))
    elif len(argv) == 2 and argv[0] == "--genai-round":
        from edgelin.bench.genai_rounds import edgelin_round_main

        edgelin_round_main(json.loads(argv[1]))
    elif len(argv) == 2 and argv[0] == "--export-checked":
        from edgelin.bench.checkpoints import export_checked_main

        export_checked_main(json.loads(argv[1]))
    else:
        sys.exit(USAGE)


if __name__ == "__main__":
    main(sys.argv[1:])
