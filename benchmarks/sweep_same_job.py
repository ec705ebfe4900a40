"""Same job, same answer: the golden corpus's random jobs through the CLI, the server and the library.

The rule, fixed before a run: for each job (``estimate_golden.random_jobs``, shuffled with seed 7, the first N),
``memplan estimate --json`` with the flags as typed, ``POST /v1/estimate`` with the job-file fields, and
``load_job`` + ``estimate`` give the same peak allocated and peak reserved bytes, or all three refuse it (exit 2,
HTTP 4xx, a ``MemplanError``).

    python benchmarks/sweep_same_job.py 400    # ~10 minutes on 2 cores

Exit 1 when any job breaks the rule.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _cli_args(model: str, flags: dict[str, Any]) -> list[str]:
    out = ["estimate", model, "--json"]
    for name, value in flags.items():
        option = "--" + name.replace("_", "-")
        out += [option] if value is True else [option, str(value)]
    return out


def sweep(count: int) -> tuple[int, int, list[tuple[Any, ...]]]:
    from starlette.testclient import TestClient
    from typer.testing import CliRunner

    from estimate_golden import random_jobs
    from memplan import estimate
    from memplan.cli import app
    from memplan.errors import MemplanError
    from memplan.inputs import JobRequest, load_job
    from memplan.serve.app import create_app

    runner, client = CliRunner(), TestClient(create_app())
    path = next(route.path for route in client.app.routes if route.path.endswith("/estimate"))
    jobs = list(random_jobs())
    random.Random(7).shuffle(jobs)
    refused, problems = 0, []
    for name, model, flags in jobs[:count]:
        try:
            loaded = load_job(JobRequest(model=model, flags=dict(flags)))
            library: dict[str, Any] | None = estimate(loaded.model, loaded.job).to_dict()
        except MemplanError:
            library = None
        cli = runner.invoke(app, _cli_args(model, flags))
        served = client.post(path, json={"model": model, **flags})
        if library is None:
            if cli.exit_code == 2 and 400 <= served.status_code < 500:
                refused += 1
            else:
                problems.append((name, "refused by the library only", cli.exit_code, served.status_code))
            continue
        if cli.exit_code != 0 or served.status_code != 200:
            problems.append((name, "estimated by the library only", cli.exit_code, served.status_code))
            continue
        answers = (library, json.loads(cli.stdout), served.json())
        for key in ("peak_allocated_bytes", "peak_reserved_bytes"):
            seen = {answer.get(key, answer.get("estimate", {}).get(key)) for answer in answers}
            if len(seen) != 1:
                problems.append((name, key, sorted(map(str, seen)), flags))
    return min(count, len(jobs)), refused, problems


def main() -> int:
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 400
    jobs, refused, problems = sweep(count)
    print(f"{jobs} jobs ({jobs - refused} estimated, {refused} refused by all three), {len(problems)} problems")
    for problem in problems:
        print("  ", *problem)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
