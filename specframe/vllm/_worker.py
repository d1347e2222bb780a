"""Child process of ``specframe.vllm.jobs.run_jobs``: engines run one after the other, one request file, one result
file.

Run as ``python -m specframe.vllm._worker REQUEST.json RESULT.json``; the ``__main__`` guard is what vLLM needs when
it spawns helpers that re-import the main module.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main(request_path: str, result_path: str) -> None:
    import attrs

    from specframe.errors import SpecframeError
    from specframe.vllm.engine import EngineOptions, VllmEngine

    request = json.loads(open(request_path).read())
    options = EngineOptions(**request["options"])
    runs = []
    try:
        for job in request["jobs"]:
            started = time.perf_counter()
            engine = VllmEngine(job["target"], job["speculative_config"], options)
            startup = time.perf_counter() - started
            before = engine.counters()
            generations = engine.generate(request["prompts"], request["max_new_tokens"], request["ignore_eos"],
                                          together=request.get("together", False))
            counters = engine.counters().minus(before)
            engine.close()
            runs.append(
                {
                    "generations": [g.as_dict() for g in generations],
                    "counters": attrs.asdict(counters),
                    "startup_seconds": startup,
                }
            )
        result = {"runs": runs}
    except SpecframeError as exc:
        result = {"error": str(exc)}
    _write(result, result_path)


def _write(result: dict, result_path: str) -> None:
    tmp = result_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, result_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    sys.stdout.flush()
    sys.stderr.flush()
    # vLLM's in-process engine leaves non-daemon threads behind; the result is on disk, so leave now.
    os._exit(0)
