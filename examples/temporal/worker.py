"""The worker: runs the workflow and its activities. Start as many as you like; kill any of them.

python -m examples.temporal.worker --temporal 127.0.0.1:7233 --runcap http://127.0.0.1:8787
"""

from __future__ import annotations

import argparse
import asyncio
import os
from datetime import timedelta

from temporalio.client import Client
from temporalio.worker import Worker

from examples.temporal.activities import AgentActivities
from examples.temporal.workflow import TASK_QUEUE, AgentWorkflow


async def run_worker(
    temporal: str,
    runcap_url: str,
    task_queue: str = TASK_QUEUE,
    *,
    admin_token: str | None = None,
    sticky_timeout_s: float = 10.0,
) -> None:
    client = await Client.connect(temporal)
    # runcap forwards the agent's key to the provider; the scripted model needs none.
    api_key = os.environ.get("OPENAI_API_KEY", "unused-by-the-scripted-model")
    activities = AgentActivities(runcap_url, api_key=api_key, admin_token=admin_token)
    worker = Worker(
        client,
        task_queue=task_queue,
        workflows=[AgentWorkflow],
        activities=[activities.call_model, activities.call_tool, activities.cancel_run],
        # A worker killed with -9 leaves its cached workflows "sticky" to it: their next workflow
        # task goes to its queue first and moves on to the others only after this timeout.
        sticky_queue_schedule_to_start_timeout=timedelta(seconds=sticky_timeout_s),
    )
    try:
        async with worker:
            print(f"worker ready: task queue {task_queue!r}, runcap {runcap_url}", flush=True)
            await asyncio.Event().wait()
    finally:
        await activities.aclose()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--temporal", default="127.0.0.1:7233", help="Temporal frontend host:port")
    p.add_argument("--runcap", default="http://127.0.0.1:8787", help="runcap's URL")
    p.add_argument("--task-queue", default=TASK_QUEUE)
    p.add_argument("--sticky-timeout-s", type=float, default=10.0, help="see run_worker (default 10)")
    args = p.parse_args()
    try:
        asyncio.run(
            run_worker(
                args.temporal, args.runcap, args.task_queue,
                admin_token=os.environ.get("RUNCAP_ADMIN_TOKEN"), sticky_timeout_s=args.sticky_timeout_s,
            )
        )  # fmt: skip
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
