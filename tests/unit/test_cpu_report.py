"""`pytest --cpu-report` (support/cpu_report.py): command lines of the suite's processes sorted into the kinds its
cost is decided by, and a process's CPU attributed to its kind."""

from __future__ import annotations

import subprocess
import sys

import pytest

from support.cpu_report import CpuSampler, kind

VENV = "/repo/.venv/bin/python"


@pytest.mark.parametrize(("cmdline", "expected"), [
    ("ray::PolicyWorker.forward_backward", "ray actor PolicyWorker"),
    ("ray::RolloutManager.heal", "ray actor RolloutManager"),
    ("ray::IDLE", "ray idle worker"),
    ("ray::DashboardAgent", "ray dashboard agent"),
    (f"{VENV}/../lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet --raylet_socket_name=x", "ray raylet"),
    (f"{VENV} -u /x/site-packages/ray/dashboard/agent.py --node-id=1 --raylet-name=/tmp/s/sockets/raylet --head",
     "ray dashboard agent"),
    ("/x/ray/core/src/ray/gcs/gcs_server --log_dir=/tmp/s/logs", "ray gcs_server"),
    (f"{VENV} /x/ray/_private/workers/setup_worker.py /x/ray/_private/workers/default_worker.py --node-ip-address=1 "
     "--raylet-name=/tmp/s/sockets/raylet --redis-address=None", "ray worker (starting)"),
    (f"{VENV} -m ray.scripts.scripts start --address 1.2.3.4:5 --num-cpus 9", "`ray start`"),
    (f"{VENV} -m kimi_pipeline.cluster.ray_start --address 1.2.3.4:5 --num-cpus 9", "`ray start`"),
    (f"{VENV} -u -c import sys;exec(eval(sys.stdin.readline()))", "pytest worker"),
    (f"{VENV} -u -m kimi_pipeline.weightjobs.rank convert --job /x/job.json", "kimi_pipeline.weightjobs.rank convert"),
    (f"{VENV} -m kimi_pipeline.weightjobs.agent --nnodes=4 --node-rank=2", "kimi_pipeline.weightjobs.agent"),
    ("/repo/.venv/bin/python /repo/.venv/bin/kimi run --run-dir /x --until train", "kimi run"),
    (f"{VENV} -m kimi_pipeline.cli rehearse tiny --out /x", "kimi rehearse"),
    (f"{VENV} -m uvicorn --app-dir /x --factory prefect.server.api.server:create_app --port 1", "prefect API server"),
    (f"{VENV} -m prefect server start --host 127.0.0.1 --port 46117", "prefect API server"),
    (f"{VENV} -m prefect.engine", "prefect.engine"),
    (f"{VENV} -m prefect deployment run kimi/full --watch", "prefect deployment"),
    (f"{VENV} -m pip install -q torch==2.13.0", "pip"),
    ("/usr/lib/chromium/chromium --type=renderer --headless", "chromium"),
    (f"{VENV} /tmp/x/burn.py", "python /tmp/x/burn.py"),
])
def test_command_lines_fall_into_their_kind(cmdline, expected):
    assert kind(cmdline) == expected


def test_a_process_cpu_is_counted_under_its_kind(tmp_path):
    burn = tmp_path / "burn.py"
    burn.write_text("import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6:\n    pass\n"
                    "time.sleep(0.5)\n")  # stays visible for a sample after its CPU is spent
    sampler = CpuSampler(interval_s=0.1).start()
    subprocess.run([sys.executable, str(burn)], check=True, timeout=60)
    sampler.stop()
    cpu, count = sampler.totals()
    name = f"python {burn}"
    assert count[name] == 1 and 0.5 <= cpu[name] <= 5, (cpu, count)
    lines = sampler.table()
    assert lines[0].startswith("CPU by kind of process") and any(line.endswith(name) for line in lines)
    # the first kind alone, or every kind (the file `make test` writes): each lists what it does not show as the rest
    assert len(sampler.table(top=1)) == (4 if len(cpu) > 1 else 3)
    every = sampler.table(top=None)
    assert len(every) == len(cpu) + 2 and not any("the other kinds" in x for x in every)
