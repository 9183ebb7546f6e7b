"""What `/admin/sql` must refuse (proxy/spans/sqlguard.py), as data: the attacks the guard is
tested against — end to end on both engines (tests/system/test_admin_sql_guard.py) and on the
guard alone (tests/unit/spans/test_sqlguard.py) — and the functions that reach outside runcap's
tables. `@CANARY@` (a secret file), `@PROBE@` (a URL that records hits) and `@OUT@` (a file a
query must not write) are filled in by each test."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Attack:
    id: str
    sql: str
    refused: str  # a fragment of the message: what was refused
    params: dict[str, Any] = field(default_factory=dict)
    by_guard: bool = True  # False: ClickHouse's own parser refuses it (a second statement)


ATTACKS = [
    # files
    Attack("file-scalar", "SELECT file('@CANARY@')", "the function file()"),
    Attack("file-proc-environ", "SELECT file('/proc/self/environ')", "the function file()"),
    Attack("file-table", "SELECT * FROM file('@CANARY@', 'LineAsString')", "the table function file()"),
    Attack("file-case-and-comment", "SELECT FiLe/**/('@CANARY@')", "the function FiLe()"),
    Attack("file-upper", "select/* x */FILE('@CANARY@') -- trailing", "the function FILE()"),
    Attack("file-in-subquery", "SELECT * FROM (SELECT file('@CANARY@') AS c)", "the function file()"),
    Attack("file-in-cte", "WITH c AS (SELECT file('@CANARY@') AS x) SELECT x FROM c", "the function file()"),
    Attack("file-as-with-alias", "WITH file('@CANARY@') AS x SELECT x", "the function file()"),
    Attack("file-in-lambda", "SELECT arrayMap(x -> file(x), ['@CANARY@'])", "the function file()"),
    Attack(
        "file-in-where",
        "SELECT count() FROM runcap.spans WHERE run_id = file('@CANARY@')",
        "the function file()",
    ),
    Attack("file-right-of-in", "SELECT 'x' IN file('@CANARY@', 'LineAsString')", "the function file()"),
    Attack("file-union", "SELECT 1 UNION ALL SELECT file('@CANARY@')", "the function file()"),
    Attack("file-apply", "SELECT * APPLY(file) FROM (SELECT '@CANARY@' AS p)", "APPLY"),
    Attack("file-by-aggregate-name", "SELECT arrayReduce('file', ['@CANARY@'])", "arrayReduce('file'"),
    # other servers, URLs, processes
    Attack("url", "SELECT * FROM url('@PROBE@', 'LineAsString')", "the table function url()"),
    Attack(
        "url-in-join", "SELECT * FROM runcap.spans, url('@PROBE@', 'LineAsString')", "table function url()"
    ),
    Attack("s3", "SELECT * FROM s3('@PROBE@', 'LineAsString')", "the table function s3()"),
    Attack("remote", "SELECT * FROM remote('127.0.0.1:9', system.one)", "the table function remote()"),
    Attack("cluster", "SELECT * FROM cluster('default', system.one)", "the table function cluster()"),
    Attack(
        "executable",
        "SELECT * FROM executable('cat', 'LineAsString', 'x String')",
        "the table function executable()",
    ),
    Attack("input", "SELECT * FROM input('x String')", "the table function input()"),
    Attack("merge", "SELECT * FROM merge('system', '^users$')", "the table function merge()"),
    Attack("view", "SELECT * FROM view(SELECT name FROM system.users)", "the table function view()"),
    Attack("dictGet", "SELECT dictGet('runcap.d', 'v', toUInt64(1))", "the function dictGet()"),
    Attack("joinGet", "SELECT joinGet('runcap.j', 'v', 1)", "the function joinGet()"),
    # server state
    Attack("getSetting", "SELECT getSetting('max_execution_time')", "the function getSetting()"),
    Attack("hostName", "SELECT hostName()", "the function hostName()"),
    Attack("currentUser", "SELECT currentUser()", "the function currentUser()"),
    Attack("sleep", "SELECT sleep(3)", "the function sleep()"),
    # other tables and databases
    Attack("system.tables", "SELECT name FROM system.tables", "the table system.tables"),
    Attack("system.settings", "SELECT name, value FROM system.settings", "the table system.settings"),
    Attack("system.processes", "SELECT query FROM system.processes", "the table system.processes"),
    Attack("system.users", "SELECT name FROM system.users", "the table system.users"),
    Attack(
        "system-in-join",
        "SELECT * FROM runcap.spans AS s JOIN system.users AS u ON 1",
        "the table system.users",
    ),
    Attack("system-in-subquery", "SELECT (SELECT count() FROM system.tables)", "the table system.tables"),
    Attack(
        "system-right-of-in",
        "SELECT count() FROM runcap.spans WHERE run_id IN system.users",
        "table system.users",
    ),
    Attack("system-column-name", "SELECT system.one.dummy", "the name system.one.dummy"),
    Attack(
        "information_schema", "SELECT * FROM information_schema.tables", "the table information_schema.tables"
    ),
    Attack(
        "INFORMATION_SCHEMA", "SELECT * FROM INFORMATION_SCHEMA.TABLES", "the table INFORMATION_SCHEMA.TABLES"
    ),
    Attack("other-database", "SELECT * FROM default.anything", "the table default.anything"),
    Attack("describe-system", "DESCRIBE TABLE system.users", "the table system.users"),
    Attack(
        "identifier-parameter", "SELECT * FROM {t:Identifier}", "{t:Identifier}", params={"t": "system.users"}
    ),
    # limits
    Attack(
        "settings-max_execution_time",
        "SELECT count() FROM runcap.spans SETTINGS max_execution_time = 0",
        "SETTINGS clause",
    ),
    Attack("settings-readonly", "SELECT 1 SETTINGS readonly = 0", "SETTINGS clause"),
    Attack(
        "settings-in-subquery", "SELECT * FROM (SELECT 1 SETTINGS max_memory_usage = 0)", "SETTINGS clause"
    ),
    Attack(
        "settings-on-union", "SELECT 1 UNION ALL SELECT 2 SETTINGS max_result_rows = 0", "SETTINGS clause"
    ),
    Attack("set", "SET max_execution_time = 0", "the statement SET"),
    # statements
    Attack("two-statements", "SELECT 1; DROP TABLE runcap.spans", "Multi-statements", by_guard=False),
    Attack(
        "two-statements-comment",
        "SELECT 1 /* ; */; SELECT file('@CANARY@')",
        "Multi-statements",
        by_guard=False,
    ),
    Attack("insert", "INSERT INTO runcap.spans (run_id) VALUES ('x')", "the statement INSERT"),
    Attack("alter", "ALTER TABLE runcap.spans DELETE WHERE 1", "the statement ALTER"),
    Attack("drop", "DROP TABLE runcap.spans", "the statement DROP"),
    Attack("create", "CREATE TABLE runcap.x ENGINE = Memory AS SELECT 1", "the statement CREATE"),
    Attack("system-statement", "SYSTEM SHUTDOWN", "the statement SYSTEM"),
    Attack("explain", "EXPLAIN SELECT file('@CANARY@')", "the statement EXPLAIN"),
    Attack("show", "SHOW TABLES FROM system", "the statement SHOW"),
    Attack("into-outfile", "SELECT * FROM runcap.spans INTO OUTFILE '@OUT@'", "INTO OUTFILE"),
    Attack("format", "SELECT 1 FORMAT JSON", "FORMAT JSON"),
    # tricks on the parse tree itself
    Attack("line-break-in-name", "SELECT 1 AS `x\n    Function tuple`", "the quoted name"),
    Attack("dotted-quoted-name", "SELECT * FROM `runcap.x`.spans", "the quoted name"),
]


# Functions that read or reveal something outside runcap's tables: never allowed.
FORBIDDEN = """
    file url s3 s3Cluster gcs azureBlobStorage hdfs remote remoteSecure cluster clusterAllReplicas
    executable input mysql postgresql jdbc odbc sqlite mongodb redis dictionary dictGet
    dictGetString dictGetOrDefault dictHas dictGetHierarchy joinGet joinGetOrNull getSetting
    getSettingOrDefault getServerSetting getMergeTreeSetting getServerPort tcpPort currentUser user
    currentDatabase currentProfiles currentRoles hostName FQDN filesystemAvailable filesystemCapacity
    filesystemUnreserved getMacro getOSKernelVersion uptime version revision buildId serverUUID
    displayName sleep sleepEachRow catboostEvaluate chdb aiGenerate aiClassify initialQueryID queryID
    currentQueryID globalVariable hasColumnInTable getClientHTTPHeader zookeeperSessionUptime
    addressToSymbol demangle logTrace formatRow timezone serverTimezone
""".split()
