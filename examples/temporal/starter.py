"""Start one agent run and print its result and what runcap counted for it.

    python -m examples.temporal.starter --id ticket-4711 --prompt "Refund order o-1 (12 EUR)" \\
        --max-usd 0.05 --mock-script refund
    python -m examples.temporal.starter --id ticket-4711 --cancel     # cancel it (and its runcap run)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import urllib.request
from dataclasses import asdict

from temporalio.client import Client

from examples.temporal.workflow import TASK_QUEUE, AgentInput, AgentWorkflow


async def start(args: argparse.Namespace) -> None:
    client = await Client.connect(args.temporal)
    if args.cancel:
        await client.get_workflow_handle(args.id).cancel()
        print(f"cancel requested for workflow {args.id}")
        return
    inp = AgentInput(
        prompt=args.prompt,
        task=args.task,
        model=args.model,
        max_usd=args.max_usd,
        max_steps=args.max_steps,
        timeout_s=args.timeout_s,
        model_headers={"X-Mock-Script": args.mock_script} if args.mock_script else {},
    )
    handle = await client.start_workflow(AgentWorkflow.run, inp, id=args.id, task_queue=args.task_queue)
    print(f"started workflow {handle.id}; waiting for it to finish")
    result = await handle.result()
    print(json.dumps(asdict(result), indent=2))
    # The run's state is an admin read (RUNCAP_ADMIN_TOKEN, or the server's data_dir/admin.token).
    token = os.environ.get("RUNCAP_ADMIN_TOKEN", "")
    ask = urllib.request.Request(
        f"{args.runcap.rstrip('/')}/runs/{args.id}", headers={"Authorization": f"Bearer {token}"}
    )
    with urllib.request.urlopen(ask, timeout=10) as r:
        state = json.loads(r.read())
    print(f"runcap: status {state['status']}, {state['steps']} steps, {state['tool_calls']} tool calls, "
          f"${state['cost_usd']} of ${state['caps']['max_usd']}")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--temporal", default="127.0.0.1:7233")
    p.add_argument("--runcap", default="http://127.0.0.1:8787")
    p.add_argument("--task-queue", default=TASK_QUEUE)
    p.add_argument("--id", required=True, help="workflow id = runcap run id")
    p.add_argument("--prompt", default="Refund order o-1, 12 EUR: it arrived broken.")
    p.add_argument("--task", default="refunds")
    p.add_argument("--model", default="gpt-4o-mini")
    p.add_argument("--max-usd", default="0.05")
    p.add_argument("--max-steps", type=int, default=10)
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--mock-script", help="X-Mock-Script for runcap's scripted upstream (e.g. refund)")
    p.add_argument("--cancel", action="store_true", help="cancel the workflow with this id instead")
    asyncio.run(start(p.parse_args()))


if __name__ == "__main__":
    main()
