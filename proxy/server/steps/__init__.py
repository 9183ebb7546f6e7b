"""The flow steps: what runcap does to a call on its way through the pipeline (`server/flow.py`),
in the order `app.py` gives them — each a `FlowStep` that overrides only the hooks it needs.

* `tenant_objects.py` — a tenant reaches only the provider objects (responses, files...) it made.
* `context.py` — the context cap (`X-Run-Max-Context-Tokens`) and the context policies, and the
  `runcap_fetch` loop of runcap's own inner calls.
* `budget.py` — the run's ceiling: dollars, tokens, steps, tool calls and the deadline, reserved
  before the call and settled after it (`billing.py`: what a call is billed for; `history.py`:
  what the run has sent before).
* `metrics.py` (in `server/`, with the registry) — Prometheus series.
* `trace.py` — one span per step into the WAL.
* `accesslog.py` — one log line per call.
"""
