"""Mutation testing of the modules that hold runcap's promises (issue 28), with mutmut 3.

    .venv/bin/python scripts/mutation.py                 # every target, then docs/mutation.md
    .venv/bin/python scripts/mutation.py auth url        # some targets
    .venv/bin/python scripts/mutation.py --list          # the targets and their tests
    .venv/bin/python scripts/mutation.py --table-only    # the doc again from docs/mutation.json
    options: --max-children N (default 1: the machine is shared), --timeout S per target
             (default 1800), --no-write (print the table, leave docs/mutation.md alone),
             --resume (go on from a stopped run's results: what it did not reach, and again
             what it did not kill, with the current tests)

Each target is one module — or the functions of one that hold the promise (the ledger's rules,
not its dataclasses) — against the fast tests that should notice. Its run happens in a scratch
copy of the working tree (git's tracked and untracked files, under $TMPDIR/runcap-mutation/),
so the tree itself is never mutated; mutmut copies the sources again into `mutants/` there and
runs only the tests that reach each mutated function, forked from one warm process.

Score = killed / (mutants - equivalent). A mutant is killed when a test failed or timed out;
"no tests" (no selected test reaches the function) and "survived" count against the score.
Equivalent mutants are listed in EQUIVALENT below with the reason; each must be one no test can
tell apart from the original. The table between the markers in docs/mutation.md is rewritten
with the scores, the surviving mutants and the time each target took.

Not part of scripts/test.sh (CI): it takes minutes per module. mutmut is installed into .venv
on first use (not a runtime dependency of runcap).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "mutation.md"
RESULTS = REPO / "docs" / "mutation.json"  # per target: each mutant's status, the time it took
BEGIN, END = "<!-- mutation:begin -->", "<!-- mutation:end -->"
MUTMUT = "mutmut>=3.8,<4"


@dataclass(frozen=True)
class Target:
    module: str  # the file mutated
    tests: tuple[str, ...]  # pytest arguments selecting its fast tests
    functions: tuple[str, ...] = ()  # globs of mutmut's function names; () = the whole module
    what: str = ""
    # its tests' ClickHouse endpoint started once for the target (RUNCAP_TEST_CLICKHOUSE_URL), not
    # once per mutant: each mutant's run is a new pytest session, whose module fixture would
    # start its own
    clickhouse: bool = False


TARGETS: dict[str, Target] = {
    "auth": Target(
        "proxy/server/auth.py",
        (
            "tests/app/test_admin_auth.py",
            "tests/app/test_trust_boundary.py",
            "-k",
            "token or tenant or admin",
        ),
        what="admin token and client tokens",
    ),
    "url": Target(
        "proxy/upstream_url.py",
        # (-k also matches module names: every test of test_upstream_url.py is in)
        (
            "tests/unit/server/test_upstream_url.py",
            "tests/app/test_trust_boundary.py",
            "-k",
            "url or path or segment",
        ),
        what="the upstream URL builder",
    ),
    "ledger-rules": Target(
        "proxy/ledger/base.py",
        # (-k also matches module names: every test of test_ledger_rules.py is in)
        (
            "tests/unit/ledger/test_ledger_rules.py",
            "tests/unit/ledger/test_ledger_contract.py",
            "tests/unit/ledger/test_run_trees.py",
            "tests/unit/ledger/test_repeats.py",
            "-k",
            "sqlite or test_ledger_rules or (test_run_trees or test_repeats) and not redis",
        ),
        functions=(
            "x_apply_*",
            "x_new_run*",
            "x_merge_caps*",
            "x_check_live*",
            "x__set_status*",
            "x_decide_step*",
            "x__reserve*",
            "x_nothing_to_enforce*",
            "x_begin_unledgered_step*",
            "x_settle_unledgered*",
            "x_same_operation*",
            "x__key_reused*",
            "x_decide_tool_call*",
            # run trees (issue 22): a chain's one ceiling, its creation and liveness
            "x_open_run*",
            "x__ended*",
            "x_check_tree_live*",
            "x_totals*",
            "x_propagate*",
            "x_add_to_subtrees*",
            "x_in_tree*",
            "x__tree_view*",
            "x__decide_tree_step*",
            "x__tree_rejection*",
            "x__check_tree_tool_call*",
            "x_tree_left_after*",
            "x__resume_if_the_tree_has_room*",
        ),
        what="caps, reservations, settlement, recovery, idempotency, run trees (Redis runs them too)",
    ),
    "run-rows": Target(
        "proxy/ledger/sqlite/runrows.py",
        # (the replay of random operations against the file, and the SQLite ledger's contract,
        # run-tree and rules tests through it)
        (
            "tests/unit/ledger/test_sqlite_run_rows.py",
            "tests/unit/ledger/test_ledger_contract.py",
            "tests/unit/ledger/test_run_trees.py",
            "-k",
            "test_sqlite_run_rows or sqlite",
        ),
        what="the SQLite ledger's kept runs (a stale one would let a call past its ceiling)",
    ),
    "context": Target(
        "proxy/server/steps/context.py",
        # (the span-recording test needs the embedded span store, which mutmut's forked runs lack)
        (
            "tests/unit/server/test_context_step.py",
            "tests/app/test_context_cap_oracle.py",
            "tests/app/test_context_signal.py",
            "-k",
            "not spans_metrics",
        ),
        functions=("x_text_words*", "x__has_unread*", "x_measure*", "xǁContextStepǁrequest*"),
        what="the context step's measure and cap",
    ),
    "budget": Target(
        "proxy/server/steps/budget.py",
        # (its pure decisions one by one: test_budget_rules.py; the allow-list, unmetered
        # endpoints and the retried settlement: test_budget_step.py;
        # the refusals of unmetered endpoints under each cap: the trust-boundary tests named)
        (
            "tests/unit/server/test_budget_rules.py",
            "tests/unit/server/test_budget_step_ledger.py",
            "tests/app/test_caps.py",
            "tests/app/test_budget_step.py",
            "tests/app/test_trust_boundary.py::test_unmetered_posts_are_refused_under_a_dollar_or_token_cap",
            "tests/app/test_trust_boundary.py::test_reads_that_could_be_writes_are_not_reads",
            "tests/app/test_trust_boundary.py::test_without_caps_unmetered_endpoints_pass_through",
            "tests/app/test_trust_boundary.py::test_operator_allow_list",
        ),
        what="the budget step (reserve, clamp, settle, final step)",
    ),
    "idempotency": Target(
        "proxy/hashing.py",
        ("tests/unit/test_hashing.py",),
        what="canonical JSON and the idempotency key",
    ),
    "wal": Target(
        "proxy/spans/wal.py",
        (
            "tests/unit/spans/test_wal_framing.py",
            "tests/unit/spans/test_wal.py",
            "-k",
            "not tmpfs and not full",
        ),
        what="the WAL's record framing",
    ),
    "sqlguard": Target(
        "proxy/spans/sqlguard.py",
        # (the guard alone against chdb's parser: the attack table, reads, the allow-list; the
        # query-file and dashboard checks read files mutmut's copy of the tree does not have, and
        # the end-to-end test starts servers per run, which made every mutant time out)
        ("tests/unit/spans/test_sqlguard.py", "-k", "not query_file and not dashboard"),
        what="what /admin/sql lets through",
        clickhouse=True,
    ),
}

# mutant name -> why no test can tell it from the original.
EQUIVALENT: dict[str, str] = {
    # auth
    "proxy.server.auth.xǁAdminGuardǁcheck__mutmut_7": "lower-cased header name: aiohttp's match any case",
    "proxy.server.auth.xǁAdminGuardǁcheck__mutmut_8": "upper-cased header name: aiohttp's match any case",
    "proxy.server.auth.xǁAdminGuardǁcheck__mutmut_9": (
        'default "XXXX" for a missing header: like "", it can never equal "Bearer <token>"'
    ),
    "proxy.server.auth.x_ensure_admin_token__mutmut_1": (
        "the first read skipped: the O_EXCL create then fails on the existing file, which is read"
    ),
    "proxy.server.auth.x_ensure_admin_token__mutmut_12": "token_urlsafe(None) is its default, 32 bytes",
    # the budget step
    "proxy.server.steps.budget.x_passthrough_allowed__mutmut_20": "zip(strict=None): not strict, the default",
    "proxy.server.steps.budget.x_passthrough_allowed__mutmut_23": "zip() without strict= is strict=False",
    "proxy.server.steps.budget.xǁBudgetStepǁsettlement__mutmut_111": (
        'cut_reason None looked up as "XXXX" instead of "": neither is a key, both give None'
    ),
    "proxy.server.steps.budget.xǁBudgetStepǁsettlement__mutmut_19": (
        "replace() without tool_uses= keeps the same mapping: usages replace it, never change it in place"
    ),
    "proxy.server.steps.budget.xǁBudgetStepǁsettlement__mutmut_64": (
        "replace() without tool_uses= keeps the same mapping: usages replace it, never change it in place"
    ),
    # the SQL guard
    "proxy.spans.sqlguard.x__aggregate_allowed__mutmut_9": (
        "len(name) >= len(suffix): a name equal to a combinator leaves '', which is no aggregate"
    ),
    **{
        f"proxy.spans.sqlguard.x_check_read_query__mutmut_{n}": (
            "the statement's first word: formatQuerySingleLine writes keywords in capitals and every "
            "statement starts with one (or with '('), so [A-Z] alone matches the same word, `first` is "
            "never None and the fallback canonical[:20] is never read"
        )
        for n in (32, 35, 39)
    },
    "proxy.spans.sqlguard.x_check_read_query__mutmut_71": "r'\\s*IDENTIFIER\\b' under re.I matches the same",
    "proxy.spans.sqlguard.x_check_read_query__mutmut_77": (
        "placeholders' values are never read: only which names the query takes"
    ),
    "proxy.spans.sqlguard.x__mask_quoted__mutmut_47": (
        "three quote characters for a quoted token instead of two: the masked text's searches (the first "
        "keyword, SETTINGS, {name:Type}) never count them"
    ),
    "proxy.spans.sqlguard.x__mask_quoted__mutmut_50": (
        "the character after a quoted token skipped: the canonical text puts a space, comma, parenthesis "
        "or bracket there, which none of the masked text's searches needs (quotes never touch: an "
        "embedded quote is written escaped)"
    ),
    "proxy.spans.sqlguard.xǁ_Walkǁroot__mutmut_81": (
        "the root's body is an ExpressionList or a TableExpression, never a Function: the parent passed "
        "with it is not read"
    ),
    **{
        f"proxy.spans.sqlguard.xǁ_Walkǁnode__mutmut_{n}": (
            "the QueryParameter node: the engine refuses a placeholder without a value before "
            "the walk (UNKNOWN_QUERY_PARAMETER); its branch is a second line no query reaches"
        )
        for n in (17, 18, 19, 20)
    },
    **{
        f"proxy.spans.sqlguard.xǁ_Walkǁfunction__mutmut_{n}": (
            "every Function node of EXPLAIN AST has its arguments (an ExpressionList) as first child"
        )
        for n in (17, 19)
    },
    # the URL builder
    "proxy.upstream_url.x__check_segment__mutmut_19": 'codec "UTF-8" is "utf-8"',
    "proxy.upstream_url.x_decode_segment__mutmut_9": 'codec "UTF-8" is "utf-8"',
    "proxy.upstream_url.x__check_segment__mutmut_38": (
        "a dot segment is at most 6 characters (%2e%2e): cut at 60 or 61, the same"
    ),
    "proxy.upstream_url.xǁBaseǁparse__mutmut_14": (
        "decoding the whole path is decoding it segment by segment: no escape contains '/'"
    ),
    "proxy.upstream_url.xǁBaseǁparse__mutmut_9": '"".split("/") is [""], joined back to ""',
    "proxy.upstream_url.xǁBaseǁtarget__mutmut_16": "yarl drops an empty query's bare '?'",
    # the SQLite ledger's kept runs
    **{
        f"proxy.ledger.sqlite.runrows.xǁRunRowsǁ__init____mutmut_{n}": (
            "another first value of `_data_version` / `_changes`: before the first transaction nothing "
            "is kept, so whether its check forgets (an empty dict) changes nothing, and the check that "
            "does not forget leaves the old value, which the next one compares again"
        )
        for n in (3, 4, 5, 6)
    },
    **{
        f"proxy.ledger.sqlite.runrows.xǁRunRowsǁbegin__mutmut_{n}": "SQLite's pragma names ignore case"
        for n in (5, 6)
    },
    "proxy.ledger.sqlite.runrows.xǁRunRowsǁbegin__mutmut_12": (
        "forgetting at RUNS_KEPT runs instead of one beyond: forgetting is always right, only a read dearer"
    ),
    # the ledger's rules
    "proxy.ledger.base.x_begin_unledgered_step__mutmut_3": (
        "the new run made without its task: decide_step's merge_caps sets the request's task on a "
        "run that has none"
    ),
    "proxy.ledger.base.x_check_tree_live__mutmut_25": (
        "deadline <= earliest: on a tie the earliest is the same value either way"
    ),
    "proxy.ledger.base.x__reserve__mutmut_90": "capped = None: falsy like False, only read as a truth value",
    "proxy.ledger.base.x__reserve__mutmut_135": (
        "-2 for -1 when the input alone is not affordable: either is below every useful minimum (>= 0), "
        "so the call is refused the same"
    ),
    # hashing (idempotency)
    "proxy.hashing.x_args_hash__mutmut_10": 'codec "UTF-8" is "utf-8": codec names are case-insensitive',
    "proxy.hashing.x_canonical_json__mutmut_19": 'codec "UTF-8" is "utf-8": codec names are case-insensitive',
    "proxy.hashing.x_canonical_json__mutmut_5": "ensure_ascii=None is falsy: the same as False",
    "proxy.hashing.x_canonical_json__mutmut_6": "allow_nan=None is falsy: the same as False",
    # the WAL
    "proxy.spans.wal.x__resync__mutmut_2": (
        "pos == limit: a pread of 0 bytes is b'', and None is returned as before"
    ),
    "proxy.spans.wal.x__resync__mutmut_14": (
        "reading past the limit: a frame is taken only when it ends by the limit, and no frame fits in "
        "the bytes the shorter read would have left"
    ),
    "proxy.spans.wal.x__resync__mutmut_64": (
        "the next magic searched from at + 2: 'RCW1' does not overlap itself, the next one is 4 bytes on"
    ),
    "proxy.spans.wal.x__fsync_dir__mutmut_6": (
        "O_RDONLY is 0: O_RDONLY & O_DIRECTORY opens the WAL's directory read-only all the same"
    ),
    "proxy.spans.wal.xǁWalWriterǁ_warn__mutmut_8": "-1e+18 is -1e18",
    "proxy.spans.wal.xǁWalWriterǁ_roll__mutmut_20": (
        "_roll_wanted = None: falsy like False, only read as a truth value"
    ),
    "proxy.spans.wal.xǁWalWriterǁ_write__mutmut_32": (
        "written = 1 for a failed writev: no record is 1 byte, so 0 whole records are kept either way, "
        "and the log names the error, not the count"
    ),
    "proxy.spans.wal.xǁWalWriterǁ_write__mutmut_34": (
        "bisect_right(ends, size) is len(ends) when all was written"
    ),
    "proxy.spans.wal.xǁWalWriterǁ_write__mutmut_76": "cut = None: only read as `not cut`, like False",
    "proxy.spans.wal.xǁWalWriterǁ_append_group__mutmut_44": (
        "a lone record framed again by _append: the same bytes, its append time at most a millisecond later"
    ),
    "proxy.spans.wal.xǁWalWriterǁ_append_group__mutmut_46": (
        "a lone record framed again by _append: the same bytes, its append time at most a millisecond later"
    ),
    **{
        f"proxy.spans.wal.xǁWalWriterǁ{m}": (
            "the rate-limit key of a warning no other warning shares: any other key (or None) limits it alike"
        )
        for m in (
            "_roll__mutmut_2",
            "_roll__mutmut_8",
            "_roll__mutmut_9",
            "_drop_bodies__mutmut_10",
            "_drop_bodies__mutmut_20",
            "_drop_bodies__mutmut_21",
            "_write__mutmut_8",
            "_write__mutmut_14",
            "_write__mutmut_15",
            "_write__mutmut_78",
            "_write__mutmut_86",
            "_write__mutmut_87",
        )
    },
    **{
        f"proxy.spans.wal.{m}": "O_RDONLY & O_CLOEXEC is O_RDONLY: close-on-exec only matters to a program "
        "exec'd while the fd is open, and it is closed before the function returns"
        for m in ("x_segment_sealed__mutmut_6", "x_read_frames__mutmut_8")
    },
    **{
        f"proxy.spans.wal.x_read_frames__mutmut_{n}": (
            "a read larger than needed, or one more read (b'XXXX' for the first empty buffer, a re-read "
            "at exactly a header's end): the frames are checked against `limit` all the same"
        )
        for n in (24, 41, 60, 61, 109, 110, 125)
    },
    **{
        f"proxy.spans.wal.x_read_frames__mutmut_{n}": (
            "a header cut short: the buffer is re-read at `pos` first (rel = 0), so len(buf) + rel and "
            "len(buf) - rel agree; and a cut header goes to the same resync, counted alike, as damage or "
            "as an incomplete frame (header_ok None/True, length 1)"
        )
        for n in (62, 64, 65, 67)
    },
    **{
        f"proxy.spans.wal.x_read_frames__mutmut_{n}": (
            "resync from pos - 1 or pos + 2 after a header whose length runs past the end: no valid frame "
            "starts at pos - 1 or pos + 1 (its magic would overlap the one at pos), and the frame at pos "
            "itself runs past the limit"
        )
        for n in (93, 94)
    },
    **{
        f"proxy.spans.wal.x_valid_end__mutmut_{n}": (
            "another max_bytes per read: the scan only takes more or fewer reads to the same end"
        )
        for n in (13, 15, 16, 17)
    },
    **{
        f"proxy.spans.wal.xǁWalWriterǁappend_step__mutmut_{n}": (
            "the payloads / parts of a record dropped because the writer is closed: never read"
        )
        for n in (7, 8)
    },
    "proxy.spans.wal.xǁWalWriterǁ_write__mutmut_94": (
        "offset > 1 for offset > 0: the offset is 0 or at least one whole record (20 bytes and more)"
    ),
    **{
        f"proxy.spans.wal.xǁWalWriterǁ_write__mutmut_{n}": (
            "the rate-limit key of a warning no other warning shares: any other key (or None) limits it alike"
        )
        for n in (103, 111, 112)
    },
    **{
        f"proxy.spans.wal.xǁWalWriterǁ_write__mutmut_{n}": (
            'the key "fsync" of the always-mode fdatasync warning: in that mode the syncer never fsyncs the '
            "active segment, the only other warning of that key"
        )
        for n in (53, 61, 62)
    },
}

KILLED = {"killed", "timeout"}


@dataclass
class Score:
    name: str
    target: Target
    statuses: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    error: str = ""

    def counts(self) -> dict[str, int]:
        out = {"mutants": len(self.statuses), "killed": 0, "survived": 0, "no tests": 0, "equivalent": 0}
        for name, status in self.statuses.items():
            if name in EQUIVALENT:
                out["equivalent"] += 1
            elif status in KILLED:
                out["killed"] += 1
            elif status == "no tests":
                out["no tests"] += 1
            else:
                out["survived"] += 1
        return out

    @property
    def score(self) -> float:
        c = self.counts()
        denominator = c["mutants"] - c["equivalent"]
        return c["killed"] / denominator if denominator else 0.0

    def survivors(self) -> list[tuple[str, str]]:
        return sorted((n, s) for n, s in self.statuses.items() if s not in KILLED and n not in EQUIVALENT)


def ensure_mutmut() -> Path:
    exe = Path(sys.executable).parent / "mutmut"
    if not exe.exists():
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", MUTMUT],
            check=True,
        )
    return exe


def scratch_copy(name: str, resume: bool = False) -> Path:
    """The tree's files in the target's scratch directory: a fresh one, or (resume) the files
    copied over the last run's, whose mutants/ keeps mutmut's results."""
    root = Path(os.environ.get("TMPDIR", tempfile.gettempdir())) / "runcap-mutation" / name
    if root.exists() and not resume:
        shutil.rmtree(root)
    root.mkdir(parents=True, exist_ok=True)
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, check=True, capture_output=True,
    ).stdout.split(b"\0")  # fmt: skip
    for raw in files:
        if not raw:
            continue
        rel = Path(raw.decode())
        src = REPO / rel
        if not (src.is_file() or src.is_symlink()) or rel.parts[0] in ("mutants", ".venv"):
            continue
        dst = root / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if dst.is_symlink() or dst.exists():
            dst.unlink()
        if src.is_symlink():
            dst.symlink_to(os.readlink(src))
        else:
            shutil.copy2(src, dst)
    return root


SHARED_CLICKHOUSE = "RUNCAP_TEST_CLICKHOUSE_URL"  # read by tests/unit/spans/test_sqlguard.py


def start_clickhouse(work: Path) -> tuple[subprocess.Popen[bytes], str]:
    """The tests' ClickHouse HTTP endpoint (tests/support/clickhouse_http.py, chdb in a process of
    its own, on a free port) for a whole target, and its URL once it listens."""
    server = subprocess.Popen(
        [sys.executable, "-m", "tests.support.clickhouse_http", str(work / ".clickhouse"), "0"],
        cwd=work, stdout=subprocess.PIPE,
    )  # fmt: skip
    assert server.stdout is not None
    url = server.stdout.readline().decode().strip()
    if not url.startswith("http://"):
        server.kill()
        server.wait()
        raise RuntimeError(f"the ClickHouse endpoint for the tests did not start (it said {url!r})")
    return server, url


def setup_cfg(target: Target, work: Path) -> str:
    # Everything tests read besides proxy/ and tests/ (queries/ behind proxy/sql, dashboards/,
    # docker-compose.yml...) goes into mutmut's copy of the tree too.
    also = sorted(p.name + ("/" if p.is_dir() else "") for p in work.iterdir() if p.name not in _OWN)
    # mutmut copies proxy/'s sources, not its symlinks: proxy/sql (-> queries/, what
    # proxy.queryfiles reads at import of proxy.readcli) is copied in with its contents.
    also += sorted(
        str(p.relative_to(work)) + "/" for p in (work / "proxy").rglob("*") if p.is_symlink() and p.is_dir()
    )
    lines = [
        "[mutmut]",
        "source_paths = proxy/",
        f"only_mutate = {target.module}",
        "pytest_add_cli_args_test_selection =",
        *(f"    {arg}" for arg in target.tests),
        "also_copy =",
        *(f"    {name}" for name in also),
        "pytest_add_cli_args =",
        "    -p",
        "    no:cacheprovider",
        "",
    ]
    return "\n".join(lines)


_OWN = {"proxy", "tests", "setup.cfg", "mutants", "pyproject.toml", "mutmut-run.log"}
_RESULT = re.compile(r"^\s*(\S+): (.+?)\s*$")


def run_target(
    name: str, target: Target, mutmut: Path, max_children: int, timeout: float, resume: bool = False
) -> Score:
    """mutmut over the target in its scratch copy. With `resume`, the last run's results stand for
    the mutants it killed; the ones it did not kill run again with the tree's current tests
    (tests only added since: a killed mutant stays killed), then the ones it did not reach."""
    score = Score(name, target)
    work = scratch_copy(name, resume)
    (work / "setup.cfg").write_text(setup_cfg(target, work))
    module = target.module.removesuffix(".py").replace("/", ".")
    globs = [f"{module}.{f}" for f in target.functions]
    started = time.monotonic()
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    log = work / "mutmut-run.log"
    again = [m for m, status in results(mutmut, work, env, module, globs).items() if status not in KILLED]
    server = None
    try:
        if target.clickhouse:
            server, env[SHARED_CLICKHOUSE] = start_clickhouse(work)
        with log.open("ab" if resume else "wb") as out:
            # (mutmut runs only the mutants without a result, unless they are named; the ones not
            # killed first, few and the score's open questions, then the ones not reached)
            for names in [again, globs] if resume and again else [globs]:
                subprocess.run(
                    [str(mutmut), "run", "--max-children", str(max_children), *names],
                    cwd=work, env=env, timeout=max(1.0, timeout - (time.monotonic() - started)),
                    stdout=out, stderr=subprocess.STDOUT,
                )  # fmt: skip
    except subprocess.TimeoutExpired:
        score.error = f"stopped after {timeout:.0f} s: the counts are of the mutants run so far"
    finally:
        if server is not None:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
    score.seconds = time.monotonic() - started
    score.statuses = results(mutmut, work, env, module, globs)
    if not score.statuses and not score.error:
        tail = log.read_bytes()[-600:].decode(errors="replace").replace("\r", "\n").strip().splitlines()
        score.error = "mutmut ran no mutant: " + " / ".join(tail[-3:])
    return score


def results(mutmut: Path, work: Path, env: dict[str, str], module: str, globs: list[str]) -> dict[str, str]:
    """Each mutant's status in mutmut's results in `work` (none before a first run)."""
    if not (work / "mutants").is_dir():
        return {}
    listed = subprocess.run(
        [str(mutmut), "results", "--all", "true"], cwd=work, env=env, capture_output=True, text=True
    ).stdout
    statuses = {}
    for line in listed.splitlines():
        m = _RESULT.match(line)
        if not m or not m.group(1).startswith(module + "."):
            continue
        mutant, status = m.groups()
        if globs and not any(fnmatch.fnmatchcase(mutant, g) for g in globs):
            continue
        if status == "not checked":
            continue  # not run (outside the globs, or the run was stopped)
        statuses[mutant] = status
    return statuses


def load_results() -> dict[str, dict[str, object]]:
    return json.loads(RESULTS.read_text()) if RESULTS.exists() else {}


def save_results(results: dict[str, dict[str, object]], scores: list[Score]) -> None:
    for s in scores:
        results[s.name] = {"statuses": s.statuses, "seconds": round(s.seconds, 1), "error": s.error}
    RESULTS.write_text(json.dumps(results, indent=1, sort_keys=True, ensure_ascii=False) + "\n")


def all_scores(results: dict[str, dict[str, object]]) -> list[Score]:
    scores = []
    for name, target in TARGETS.items():
        r = results.get(name)
        if r is not None:
            scores.append(Score(name, target, dict(r["statuses"]), float(r["seconds"]), str(r["error"])))  # type: ignore[call-overload, arg-type]
    return scores


def table(scores: list[Score]) -> str:
    rows = [
        "| target | module (scope) | mutants | killed | survived | no tests | equivalent | score | time |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in scores:
        c = s.counts()
        scope = s.target.module + (" (rules)" if s.target.functions else "")
        rows.append(
            f"| {s.name} | `{scope}` | {c['mutants']} | {c['killed']} | {c['survived']} | {c['no tests']} | "
            f"{c['equivalent']} | **{s.score:.0%}** | {s.seconds / 60:.1f} min |"
        )
    out = ["\n".join(rows), ""]
    for s in scores:
        if s.error:
            out.append(f"* {s.name}: {s.error}")
    for s in scores:
        survivors = s.survivors()
        if not survivors:
            continue
        out.append(f"\n<details><summary>{s.name}: {len(survivors)} not killed</summary>\n")
        out.extend(f"* `{n}`: {status}" for n, status in survivors)
        out.append("\n</details>")
    return "\n".join(out) + "\n"


def write_doc(text: str) -> None:
    doc = DOC.read_text()
    start, end = doc.index(BEGIN) + len(BEGIN), doc.index(END)
    DOC.write_text(doc[:start] + "\n" + text + doc[end:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("targets", nargs="*", help=f"of: {', '.join(TARGETS)} (default: all)")
    ap.add_argument("--max-children", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument(
        "--resume", action="store_true",
        help="go on from the last (stopped) run's results in the scratch copy: run what it did not "
        "reach, and again what it did not kill, with the tree's current tests",
    )  # fmt: skip
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--table-only", action="store_true", help="docs/mutation.md from docs/mutation.json")
    args = ap.parse_args()
    if args.table_only:
        write_doc(table(all_scores(load_results())))
        return 0
    if args.list:
        for name, t in TARGETS.items():
            print(f"{name:13} {t.module:32} {' '.join(t.tests)}  — {t.what}")
        return 0
    unknown = [t for t in args.targets if t not in TARGETS]
    if unknown:
        ap.error(f"unknown target(s) {', '.join(unknown)}; known: {', '.join(TARGETS)}")
    mutmut = ensure_mutmut()
    scores = []
    for name in args.targets or list(TARGETS):
        print(f"{name}: mutating {TARGETS[name].module} ...", flush=True)
        s = run_target(name, TARGETS[name], mutmut, args.max_children, args.timeout, args.resume)
        c = s.counts()
        print(f"{name}: {s.score:.0%} killed ({c}) in {s.seconds:.0f} s {s.error}", flush=True)
        scores.append(s)
        if not args.no_write:  # after each target: a long run keeps what it finished
            results = load_results()
            save_results(results, [s])
            write_doc(table(all_scores(results)))
    print(table(scores))
    return 0


if __name__ == "__main__":
    sys.exit(main())
