"""`kill -9` of the proxy mid-run: spend and caps survive, the dead process's reservation is
settled at its reserved amount, and the cap is still enforced after the restart."""

from __future__ import annotations

import asyncio
from decimal import Decimal

import aiohttp
import openai

from tests.conftest import RuncapProcess


async def test_kill9_mid_run_keeps_spend_and_caps(upstream, tmp_path):  # type: ignore[no-untyped-def]
    upstream.scripts["essay"] = [{"text_tokens": 300}]
    upstream.scripts["hang"] = [{"text": "never", "delay_s": 60}]
    config = tmp_path / "runcap.toml"
    config.write_text(f'log_requests = false\n[upstreams.openai]\nurl = "{upstream.url}"\n')
    proc = RuncapProcess(config, tmp_path / "data")
    proc.start()
    try:
        c = openai.AsyncOpenAI(base_url=f"{proc.url}/v1", api_key="k", max_retries=0)
        h = {
            "X-Run-Id": "durable",
            "X-Run-Max-Usd": "0.05",
            "X-Run-Max-Steps": "20",
            "X-Mock-Script": "essay",
        }
        for _ in range(3):
            await c.chat.completions.create(
                model="gpt-4o", messages=[{"role": "user", "content": "go"}], max_tokens=500, extra_headers=h
            )
        async with aiohttp.ClientSession() as s, s.get(f"{proc.url}/runs/durable", headers=proc.admin) as r:
            before = await r.json()
        assert before["steps"] == 3

        # A call in flight (its worst case reserved) when the process dies.
        hung = asyncio.create_task(
            c.chat.completions.create(
                model="gpt-4o", messages=[{"role": "user", "content": "go"}], max_tokens=500,
                extra_headers={**h, "X-Mock-Script": "hang"},
            )
        )  # fmt: skip
        for _ in range(100):
            if upstream.requests and upstream.last.script == "hang":
                break
            await asyncio.sleep(0.02)
        proc.kill9()
        try:
            await hung
        except openai.APIError:
            pass

        proc.start()  # same data dir
        async with aiohttp.ClientSession() as s, s.get(f"{proc.url}/runs/durable", headers=proc.admin) as r:
            after = await r.json()
        assert after["caps"] == before["caps"]
        assert after["steps"] == 4
        assert after["reserved_usd"] == "0.000000000"
        # Settled conservatively: the dead call is charged its whole reservation (500 output
        # tokens of gpt-4o = $0.005 plus its input bound).
        charged = Decimal(after["cost_usd"]) - Decimal(before["cost_usd"])
        assert charged > Decimal("0.005")
        assert after["output_tokens"] - before["output_tokens"] == 500

        # Still enforced: the run stops at its cap.
        spent_ok = 0
        while True:
            try:
                await c.chat.completions.create(
                    model="gpt-4o",
                    messages=[{"role": "user", "content": "go"}],
                    max_tokens=500,
                    extra_headers=h,
                )
                spent_ok += 1
                assert spent_ok < 30
            except openai.APIStatusError as e:
                assert e.status_code == 402
                break
        async with aiohttp.ClientSession() as s, s.get(f"{proc.url}/runs/durable", headers=proc.admin) as r:
            final = await r.json()
        assert Decimal(final["cost_usd"]) <= Decimal("0.05")
    finally:
        proc.stop()
    log = (tmp_path / "runcap.log").read_text()
    assert "died at its reserved amount" in log  # recovery says what it did
