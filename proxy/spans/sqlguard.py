"""The guard in front of every read of the span store that runs someone's SQL — `POST /admin/sql`,
`runcap query | sql | runs`, dashboards through runcap: the query reads runcap's tables and nothing
else (DESIGN.md "Trust model").

ClickHouse's own `readonly` is not that promise. It stops writes and DDL, but with readonly=1 the
scalar `file('/proc/self/environ')` still reads runcap's environment on embedded chdb, and with
readonly=2 (what clickhouse-connect needs over HTTP) `url()`, `s3()`, `remote()`, system tables and
a `SETTINGS max_execution_time = 0` clause all work. So `check_read_query` lets ClickHouse parse
the query and judges the parse tree itself, the same way wherever the engine runs (in-process
chdb, another process, a server): it only needs `run_explain`, a callable that runs one read-only
statement on the store and returns the first column of its rows.

1. `SELECT formatQuerySingleLine({q:String})`: ClickHouse's parser turns the query into canonical
   single-line SQL — exactly one statement (a second one is a syntax error: "Multi-statements are
   not allowed"), comments dropped, names quoted and escaped. The canonical text is what gets
   explained *and executed*, so the query that runs is the query that was checked (no comment,
   quoting or client-side `%` substitution trick can make them differ).
2. Lexical checks on the canonical text: a statement other than SELECT/WITH/DESCRIBE, a
   `SETTINGS` clause, an `{x:Identifier}` parameter (it would substitute a table name after the
   check), and quoted names holding escapes, dots or parentheses (a name with a line break would
   forge lines in step 3's tree dump; a dot would make `db.table` ambiguous) are refused.
3. `EXPLAIN AST <canonical>` with the query's own parameters (substituted, so parameter values are
   checked as the literals they become) gives the parse tree. It is read strictly — one node per
   line, one space of indent per level, every `(children N)` matching — and walked:

   * the root is one SELECT (UNION / INTERSECT / EXCEPT / WITH allowed) or `DESCRIBE TABLE`, with
     no `INTO OUTFILE`, no `FORMAT` (beyond the `Native` the driver itself appends), no
     `SETTINGS` anywhere;
   * every node is of a kind on `NODE_KINDS` (e.g. `* APPLY(f)` is refused: it names a function
     the tree does not show);
   * every table is in the runcap database: `spans`, `runcap.spans`, a CTE name — never
     `system.*`, `information_schema.*` or another database, including a table on the right of
     `IN` and `db.table.column` names (ClickHouse resolves `SELECT system.one.dummy` without a
     FROM); no table functions at all (`file`, `url`, `s3`, `remote`, `numbers`, `merge`, ...);
   * every function is on the allow-list below (with aggregate combinators: `quantileExactIf`,
     `groupUniqArrayArray`, ...), and `arrayReduce('median', ...)`-style functions name an
     allowed aggregate in a string literal.

Why an allow-list of functions rather than a deny-list: ClickHouse grows functions that reach
outside the query every release — `file`, `dictGet*`, `joinGet`, `getSetting`, `hostName`,
`filesystem*`, `getMacro`, `catboostEvaluate`, `chdb()`, the `ai*` functions that call model APIs
— and a deny-list is always one release behind the engine it guards. An allow-list fails closed:
a new or forgotten function is refused with its name in the message, and allowing it is a
one-line, reviewed change. What is on it is pure: arithmetic, comparison and logic, conditionals,
type conversion, dates, strings, regular expressions, arrays, maps, tuples, JSON, URLs and IPs
parsed from strings, hashes, rounding, math, and the aggregate and window functions.

What the guard does not decide: how much a query may cost. The store's reader carries
`QUERY_LIMITS` (per query on chdb; on a server also the `runcap_reader` settings profile with
constraints, docs/admin-sql.md), and no SETTINGS clause can reach them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# Runs one read-only statement on the store (with `{name:Type}` parameters) and returns the first
# column of its rows.
RunExplain = Callable[[str, Mapping[str, Any] | None], Sequence[Any]]

READONLY = 164  # ClickHouse's code for "not allowed in readonly mode": writes, DDL, SET, ...
ACCESS_DENIED = 497  # ClickHouse's code for reaching what the user may not


class QueryRefused(Exception):
    """The guard refused a query; the message names what was refused. `code` is the ClickHouse
    exception code the same refusal would carry from the server (164 READONLY for a statement
    that is not a read, 497 ACCESS_DENIED otherwise)."""

    def __init__(self, what: str, code: int = ACCESS_DENIED) -> None:
        super().__init__(f"refused: {what}")
        self.what = what
        self.code = code


@dataclass(frozen=True)
class ReadQuery:
    """A query that passed the guard: the canonical SQL to run and the parameters it uses."""

    sql: str
    params: dict[str, Any] = field(default_factory=dict)


def check_read_query(
    sql: str, run_explain: RunExplain, *, params: Mapping[str, Any] | None = None, database: str = "runcap"
) -> ReadQuery:
    """Refuse (QueryRefused) anything but one read of `database`'s tables with pure functions;
    return the canonical statement to execute instead of `sql`, with the parameters it uses.

    Errors of `run_explain` (a syntax error, two statements, a parameter without a value, the
    store unreachable) propagate unchanged."""
    text = sql.strip()
    if not text:
        raise QueryRefused("an empty query", READONLY)
    canonical = str(run_explain("SELECT formatQuerySingleLine({q:String})", {"q": text})[0]).strip()
    masked = _mask_quoted(canonical)
    first = re.match(r"\(*\s*([A-Za-z]+)", masked)
    keyword = first.group(1).upper() if first else canonical[:20]
    if keyword not in ("SELECT", "WITH", "DESCRIBE"):
        raise QueryRefused(f"the statement {keyword}: /admin/sql runs one SELECT (or DESCRIBE)", READONLY)
    if re.search(r"\bSETTINGS\s+\w+\s*=", masked):  # the clause; a column named settings is fine
        raise QueryRefused(_SETTINGS_REFUSED)
    placeholders: dict[str, str] = {}
    for m in re.finditer(r"\{\s*(\w+)\s*:\s*([^{}]*)\}", masked):
        if re.match(r"\s*identifier\b", m.group(2), re.I):
            raise QueryRefused(
                f"the parameter {{{m.group(1)}:Identifier}}: name tables in the SQL, not in parameters"
            )
        placeholders[m.group(1)] = m.group(2)
    # Only `{name:Type}` placeholders take parameters: without one the driver would format the
    # values into the text client-side, after the check.
    used = {k: v for k, v in (params or {}).items() if k in placeholders}
    lines = [str(line) for line in run_explain(f"EXPLAIN AST {canonical}", used or None)]
    try:
        _Walk(database).root(_parse_tree(lines))
    except RecursionError:
        raise QueryRefused("a query nested deeper than runcap's check reads") from None
    return ReadQuery(canonical, used)


# -- what may appear ----------------------------------------------------------------------------

# Parse-tree node kinds a read may contain (EXPLAIN AST names). Not here, so refused: `Set`
# (SETTINGS), `ColumnsApplyTransformer` (APPLY names a function the tree does not show),
# `QueryParameter` (a parameter left unsubstituted), and every statement kind but the two roots.
NODE_KINDS = frozenset(
    """
    SelectWithUnionQuery SelectIntersectExceptQuery SelectQuery ExpressionList Function Identifier
    Literal Asterisk QualifiedAsterisk ColumnsListMatcher ColumnsRegexpMatcher
    QualifiedColumnsListMatcher QualifiedColumnsRegexpMatcher ColumnsTransformerList
    ColumnsExceptTransformer ColumnsReplaceTransformer ColumnsReplaceTransformer::Replacement
    TablesInSelectQuery TablesInSelectQueryElement TableExpression TableIdentifier TableJoin ArrayJoin
    Subquery OrderByElement WithElement WindowDefinition WindowListElement InterpolateElement
    SampleRatio
    """.split()
)

# toInt8 ... toDecimal256, toDate ... toDateTime64, with their OrZero / OrNull / OrDefault forms.
_NUMBER_AND_DATE_CONVERSIONS = frozenset(
    {
        f"to{target}{variant}"
        for target in (
            "Int8 Int16 Int32 Int64 Int128 Int256 UInt8 UInt16 UInt32 UInt64 UInt128 UInt256 Float32 "
            "Float64 BFloat16 Decimal32 Decimal64 Decimal128 Decimal256 Date Date32 DateTime DateTime32 "
            "DateTime64"
        ).split()
        for variant in ("", "OrZero", "OrNull", "OrDefault")
    }
)

# Scalar functions a read may call: pure computations on their arguments. Operators appear under
# their function names (`a + b` is plus, `x IN (...)` is in, `m['k']` is arrayElement, `x -> ...`
# is lambda).
SCALAR_FUNCTIONS = (
    frozenset(
        """
    plus minus multiply divide divideOrNull intDiv intDivOrZero intDivOrNull modulo moduloOrZero
    moduloOrNull positiveModulo positiveModuloOrNull negate abs gcd lcm divideDecimal multiplyDecimal
    max2 min2 midpoint byteSwap isFinite isInfinite isNaN ifNotFinite mod pmod positive_modulo

    equals notEquals less greater lessOrEquals greaterOrEquals isDistinctFrom isNotDistinctFrom
    in notIn globalIn globalNotIn nullIn notNullIn globalNullIn globalNotNullIn
    and or not xor if multiIf caseWithExpression greatest least clamp
    lambda tuple array map arrayElement arrayElementOrNull tupleElement exists grouping

    isNull isNotNull isNullable isZeroOrNull coalesce ifNull nullIf assumeNotNull toNullable
    firstNonDefault

    CAST _CAST accurateCast accurateCastOrNull accurateCastOrDefault toString toFixedString
    toStringCutToZero toBool toDecimalString toLowCardinality toTypeName
    toDate toDate32 toDateTime toDateTime32 toDateTime64 toUUID toIPv4 toIPv6 toTime toTime64
    toInterval toIntervalNanosecond toIntervalMicrosecond toIntervalMillisecond toIntervalSecond
    toIntervalMinute toIntervalHour toIntervalDay toIntervalWeek toIntervalMonth toIntervalQuarter
    toIntervalYear
    parseDateTime parseDateTimeOrNull parseDateTimeOrZero parseDateTime64 parseDateTime64OrNull
    parseDateTime64OrZero parseDateTimeBestEffort parseDateTimeBestEffortOrNull
    parseDateTimeBestEffortOrZero parseDateTimeBestEffortUS parseDateTimeBestEffortUSOrNull
    parseDateTimeBestEffortUSOrZero parseDateTime32BestEffort parseDateTime32BestEffortOrNull
    parseDateTime32BestEffortOrZero parseDateTime64BestEffort parseDateTime64BestEffortOrNull
    parseDateTime64BestEffortOrZero parseDateTime64BestEffortUS parseDateTime64BestEffortUSOrNull
    parseDateTime64BestEffortUSOrZero parseDateTimeInJodaSyntax parseDateTimeInJodaSyntaxOrNull
    parseDateTimeInJodaSyntaxOrZero parseDateTime64InJodaSyntax parseDateTime64InJodaSyntaxOrNull
    parseDateTime64InJodaSyntaxOrZero str_to_date TO_UNIXTIME
    fromUnixTimestamp64Second fromUnixTimestamp64Milli fromUnixTimestamp64Micro fromUnixTimestamp64Nano
    toUnixTimestamp64Second toUnixTimestamp64Milli toUnixTimestamp64Micro toUnixTimestamp64Nano
    parseReadableSize parseReadableSizeOrNull parseReadableSizeOrZero parseTimeDelta

    now now64 today yesterday nowInBlock nowInBlock64 current_date current_timestamp localtimestamp
    curdate UTCTimestamp UTC_timestamp timestamp
    toYear toQuarter toMonth toDayOfYear toDayOfMonth toDayOfWeek toHour toMinute toSecond
    toMillisecond toMicrosecond toNanosecond toUnixTimestamp toISOYear toISOWeek toWeek toYearWeek
    toDaysInMonth toLastDayOfMonth toLastDayOfWeek toMonday toYYYYMM toYYYYMMDD toYYYYMMDDhhmmss
    toStartOfYear toStartOfISOYear toStartOfQuarter toStartOfMonth toStartOfWeek toStartOfDay
    toStartOfHour toStartOfFifteenMinutes toStartOfTenMinutes toStartOfFiveMinutes
    toStartOfFiveMinute toStartOfMinute toStartOfSecond toStartOfMillisecond toStartOfMicrosecond
    toStartOfNanosecond toStartOfInterval date_bin time_bucket
    toRelativeYearNum toRelativeQuarterNum toRelativeMonthNum toRelativeWeekNum toRelativeDayNum
    toRelativeHourNum toRelativeMinuteNum toRelativeSecondNum toDaysSinceYearZero
    toModifiedJulianDay toModifiedJulianDayOrNull fromModifiedJulianDay fromModifiedJulianDayOrNull
    fromDaysSinceYearZero fromDaysSinceYearZero32 toMonthNumSinceEpoch toYearNumSinceEpoch
    toTimezone toTimeZone timezoneOf timeZoneOf timezoneOffset timeZoneOffset toUTCTimestamp
    fromUTCTimestamp to_utc_timestamp from_utc_timestamp fromUnixTimestamp FROM_UNIXTIME
    fromUnixTimestampInJodaSyntax formatDateTime formatDateTimeInJodaSyntax DATE_FORMAT dateName
    monthName dateDiff date_diff DATE_DIFF timestampDiff timestamp_diff TIMESTAMP_DIFF age timeDiff
    dateTrunc DATE_TRUNC addYears addQuarters addMonths addWeeks addDays addHours addMinutes
    addSeconds addMilliseconds addMicroseconds addNanoseconds addInterval addTupleOfIntervals
    addDate subtractYears subtractQuarters subtractMonths subtractWeeks subtractDays subtractHours
    subtractMinutes subtractSeconds subtractMilliseconds subtractMicroseconds subtractNanoseconds
    subtractInterval subtractTupleOfIntervals subDate timeSlot timeSlots makeDate makeDate32
    makeDateTime makeDateTime64 YYYYMMDDToDate YYYYMMDDToDate32 YYYYMMDDhhmmssToDateTime
    YYYYMMDDhhmmssToDateTime64 changeYear changeMonth changeDay changeHour changeMinute changeSecond
    YEAR QUARTER MONTH DAY DAYOFMONTH DAYOFWEEK DAYOFYEAR HOUR MINUTE SECOND MILLISECOND MICROSECOND
    NANOSECOND LAST_DAY yearweek week TO_DAYS FROM_DAYS

    length empty notEmpty lengthUTF8 CHAR_LENGTH CHARACTER_LENGTH OCTET_LENGTH lower upper lcase
    ucase lowerUTF8 upperUTF8 initcap initcapUTF8 caseFoldUTF8 reverse reverseUTF8 concat
    concatAssumeInjective concatWithSeparator concatWithSeparatorAssumeInjective concat_ws substring
    substr mid byteSlice substringUTF8 substringIndex substringIndexUTF8 SUBSTRING_INDEX left right
    leftUTF8 rightUTF8 leftPad rightPad leftPadUTF8 rightPadUTF8 lpad rpad repeat space trimBoth
    trimLeft trimRight trim ltrim rtrim appendTrailingCharIfAbsent startsWith endsWith
    startsWithUTF8 endsWithUTF8 startsWithCaseInsensitive endsWithCaseInsensitive
    startsWithCaseInsensitiveUTF8 endsWithCaseInsensitiveUTF8 firstLine isValidUTF8 toValidUTF8
    isValidASCII isASCII ascii char format printf overlay overlayUTF8 translate translateUTF8
    replaceAll replace replaceOne replaceRegexpAll replaceRegexpOne REGEXP_REPLACE regexpQuoteMeta
    regexpExtract REGEXP_EXTRACT REGEXP_SUBSTR regexpPosition regexpInstr regexp_instr
    normalizeUTF8NFC normalizeUTF8NFD normalizeUTF8NFKC normalizeUTF8NFKD normalizeUTF8NFKCCasefold
    removeDiacriticsUTF8 removeAccentsUTF8 soundex naturalSortKey NATURAL_SORT_KEY
    encodeXMLComponent decodeXMLComponent decodeHTMLComponent extractTextFromHTML
    base64Encode base64Decode tryBase64Decode base64URLEncode base64URLDecode tryBase64URLDecode
    base32Encode base32Decode tryBase32Decode base58Encode base58Decode tryBase58Decode TO_BASE64
    FROM_BASE64 hex unhex bin unbin bitmaskToArray bitmaskToList bitPositionsToArray
    editDistance editDistanceUTF8 levenshteinDistance levenshteinDistanceUTF8 damerauLevenshteinDistance
    jaroSimilarity jaroWinklerSimilarity stringJaccardIndex stringJaccardIndexUTF8 byteHammingDistance
    mismatches compareSubstrings
    position positionUTF8 positionCaseInsensitive positionCaseInsensitiveUTF8 locate instr
    like notLike ilike notILike match notMatch REGEXP_MATCHES matchCaseInsensitive
    notMatchCaseInsensitive extract extractAll extractGroups extractAllGroups
    extractAllGroupsHorizontal extractAllGroupsVertical countMatches countMatchesCaseInsensitive
    countSubstrings countSubstringsCaseInsensitive countSubstringsCaseInsensitiveUTF8
    hasToken hasTokenOrNull hasTokenCaseInsensitive hasTokenCaseInsensitiveOrNull hasAnyTokens
    hasAllTokens hasPhrase hasSubsequence hasSubsequenceUTF8 hasSubsequenceCaseInsensitive
    hasSubsequenceCaseInsensitiveUTF8 multiSearchAny multiSearchAnyUTF8 multiSearchAnyCaseInsensitive
    multiSearchAnyCaseInsensitiveUTF8 multiSearchFirstIndex multiSearchFirstPosition
    multiSearchAllPositions multiMatchAny multiMatchAnyIndex multiMatchAllIndices
    ngramDistance ngramDistanceUTF8 ngramSearch ngramSearchUTF8
    splitByChar splitByString splitByRegexp splitByWhitespace splitByNonAlpha splitByAlpha
    alphaTokens tokens ngrams arrayStringConcat array_to_string

    arrayMap arrayFilter arrayFill arrayReverseFill arraySplit arrayReverseSplit arrayExists arrayAll
    arrayCount arraySum arrayAvg arrayMin arrayMax arrayProduct arrayFirst arrayFirstOrNull
    arrayFirstIndex arrayLast arrayLastOrNull arrayLastIndex arrayCumSum arrayCumSumNonNegative
    arrayDifference arrayDistinct arrayEnumerate arrayEnumerateDense arrayEnumerateUniq
    arrayEnumerateDenseRanked arrayEnumerateUniqRanked arrayReduce arrayReduceInRanges arrayFold
    arraySort arrayReverseSort arrayPartialSort arrayPartialReverseSort arrayReverse arraySlice
    arrayConcat arrayPushBack arrayPushFront arrayPopBack arrayPopFront arrayResize arrayCompact
    arrayZip arrayZipUnaligned arrayFlatten flatten arrayIntersect arrayUnion arraySymmetricDifference
    arrayExcept arrayJaccardIndex arrayUniq arrayJoin unnest arrayRemove array_remove arrayShiftLeft
    arrayShiftRight arrayRotateLeft arrayRotateRight arrayTopK arrayBottomK arrayElementOrNull
    arrayWithConstant arrayDotProduct arrayAUCPR arrayROCAUC arrayAUC arrayPRAUC
    arrayLevenshteinDistance arrayShingles arrayTranspose arrayNormalizedGini arrayAutocorrelation
    has hasAll hasAny hasSubstr notHas indexOf indexOfAssumeSorted countEqual range replicate
    CARDINALITY emptyArrayUInt8 emptyArrayUInt16 emptyArrayUInt32 emptyArrayUInt64 emptyArrayInt8
    emptyArrayInt16 emptyArrayInt32 emptyArrayInt64 emptyArrayFloat32 emptyArrayFloat64
    emptyArrayDate emptyArrayDateTime emptyArrayString emptyArrayToSingle

    mapKeys mapValues mapContains mapContainsKey mapContainsValue mapContainsKeyLike
    mapContainsValueLike mapExtractKeyLike mapExtractValueLike mapFilter mapApply mapExists mapAll
    mapSort mapReverseSort mapPartialSort mapPartialReverseSort mapAdd mapSubtract mapConcat
    mapUpdate mapFromArrays MAP_FROM_ARRAYS mapPopulateSeries extractKeyValuePairs
    extractKeyValuePairsWithEscaping str_to_map mapFromString
    tupleNames tupleConcat tuplePlus tupleMinus tupleMultiply tupleDivide tupleNegate
    tupleMultiplyByNumber tupleDivideByNumber tupleModulo tupleModuloByNumber tupleIntDiv
    tupleIntDivByNumber tupleHammingDistance tupleToNameValuePairs flattenTuple dotProduct
    scalarProduct

    JSONHas JSONLength JSONArrayLength JSON_ARRAY_LENGTH JSONType JSONKey JSONExtract
    JSONExtractUInt JSONExtractInt JSONExtractFloat JSONExtractBool JSONExtractString JSONExtractRaw
    JSONExtractArrayRaw JSONExtractKeys JSONExtractKeysAndValues JSONExtractKeysAndValuesRaw
    JSONExtractCaseInsensitive JSONExtractStringCaseInsensitive JSONExtractRawCaseInsensitive
    JSON_EXISTS JSON_VALUE JSON_QUERY isValidJSON toJSONString JSONMergePatch jsonMergePatch
    simpleJSONHas simpleJSONExtractUInt simpleJSONExtractInt simpleJSONExtractFloat
    simpleJSONExtractBool simpleJSONExtractRaw simpleJSONExtractString visitParamHas
    visitParamExtractUInt visitParamExtractInt visitParamExtractFloat visitParamExtractBool
    visitParamExtractRaw visitParamExtractString dynamicElement dynamicType variantElement variantType

    protocol domain domainWithoutWWW domainRFC domainWithoutWWWRFC topLevelDomain topLevelDomainRFC
    firstSignificantSubdomain firstSignificantSubdomainRFC cutToFirstSignificantSubdomain
    cutToFirstSignificantSubdomainWithWWW port portRFC path pathFull queryString fragment
    queryStringAndFragment netloc extractURLParameter extractURLParameters extractURLParameterNames
    URLHierarchy URLPathHierarchy cutWWW cutQueryString cutFragment cutQueryStringAndFragment
    cutURLParameter decodeURLComponent encodeURLComponent decodeURLFormComponent
    encodeURLFormComponent
    IPv4NumToString IPv4StringToNum IPv4StringToNumOrNull IPv4StringToNumOrDefault IPv4ToIPv6
    IPv6NumToString IPv6StringToNum IPv6StringToNumOrNull IPv6StringToNumOrDefault IPv4CIDRToRange
    IPv6CIDRToRange isIPv4String isIPv6String isIPAddressInRange cutIPv6 toIPv4OrNull toIPv4OrZero
    toIPv4OrDefault toIPv6OrNull toIPv6OrZero toIPv6OrDefault INET_ATON INET_NTOA INET6_ATON
    INET6_NTOA MACNumToString MACStringToNum MACStringToOUI
    generateUUIDv4 generateUUIDv7 UUIDStringToNum UUIDNumToString UUIDToNum UUIDv7ToDateTime
    toUUIDOrNull toUUIDOrZero toUUIDOrDefault

    cityHash64 sipHash64 sipHash128 halfMD5 MD4 MD5 SHA1 SHA224 SHA256 SHA384 SHA512 xxHash32
    xxHash64 xxh3 murmurHash2_32 murmurHash2_64 murmurHash3_32 murmurHash3_64 murmurHash3_128
    farmFingerprint64 farmHash64 metroHash64 javaHash hiveHash wyHash64 CRC32 CRC32IEEE CRC64
    intHash32 intHash64

    round roundBankers floor ceil ceiling trunc truncate roundDown roundToExp2 roundDuration roundAge
    exp exp2 exp10 log ln log2 log10 log1p sqrt cbrt pow power intExp2 intExp10 pi e sin cos tan
    asin acos atan atan2 sinh cosh tanh asinh acosh atanh hypot degrees radians sign erf erfc
    lgamma tgamma factorial sigmoid widthBucket width_bucket
    bitAnd bitOr bitXor bitNot bitShiftLeft bitShiftRight bitRotateLeft bitRotateRight bitSlice
    bitTest bitTestAll bitTestAny bitCount bitHammingDistance
    L1Norm L2Norm LinfNorm LpNorm L1Distance L2Distance L2SquaredDistance LinfDistance LpDistance
    cosineDistance L1Normalize L2Normalize LinfNormalize LpNormalize
    rand rand32 rand64 randCanonical randUniform randNormal randLogNormal randExponential
    randBernoulli randBinomial randPoisson

    throwIf transform bar formatReadableSize FORMAT_BYTES formatReadableDecimalSize
    formatReadableQuantity formatReadableTimeDelta visibleWidth runningDifference
    runningDifferenceStartingWithFirstValue neighbor rowNumberInBlock rowNumberInAllBlocks
    materialize identity ignore isConstant finalizeAggregation initializeAggregation
    runningAccumulate byteSize countDigits isDecimalOverflow defaultValueOfArgumentType
    defaultValueOfTypeName getSizeOfEnumType
    """.split()
    )
    | _NUMBER_AND_DATE_CONVERSIONS
)


# Aggregate (and window) functions. Combinators are accepted on top of them: If, Array, Map,
# ForEach, Distinct, OrDefault, OrNull, Resample, State, SimpleState, Merge, MergeState, ArgMin,
# ArgMax, Null, Tuple.
AGGREGATE_FUNCTIONS = frozenset(
    """
    count countDistinct sum avg min max any anyLast any_respect_nulls anyLast_respect_nulls anyHeavy
    argMin argMax argAndMin argAndMax min_by max_by any_value first_value last_value
    first_value_respect_nulls last_value_respect_nulls sumWithOverflow sumKahan sumCount avgWeighted
    uniq uniqExact uniqCombined uniqCombined64 uniqHLL12 uniqTheta uniqUpTo
    groupArray groupUniqArray groupArrayInsertAt groupArrayLast groupArraySample groupArraySorted
    groupArrayMovingSum groupArrayMovingAvg groupArrayIntersect groupConcat group_concat string_agg
    array_agg groupBitAnd groupBitOr groupBitXor BIT_AND BIT_OR BIT_XOR groupBitmap groupBitmapAnd
    groupBitmapOr groupBitmapXor sumMap minMap maxMap sumMapWithOverflow topK topKWeighted
    approx_top_k approx_top_count approx_top_sum histogram
    quantile quantiles quantileExact quantilesExact quantileExactLow quantilesExactLow
    quantileExactHigh quantilesExactHigh quantileExactExclusive quantilesExactExclusive
    quantileExactInclusive quantilesExactInclusive quantileExactWeighted quantilesExactWeighted
    quantileExactWeightedInterpolated quantilesExactWeightedInterpolated quantileInterpolatedWeighted
    quantilesInterpolatedWeighted quantileTiming quantilesTiming quantileTimingWeighted
    quantilesTimingWeighted quantileTDigest quantilesTDigest quantileTDigestWeighted
    quantilesTDigestWeighted quantileBFloat16 quantilesBFloat16 quantileBFloat16Weighted
    quantilesBFloat16Weighted quantileDeterministic quantilesDeterministic quantileGK quantilesGK
    quantileDD quantilesDD
    median medianExact medianExactLow medianExactHigh medianExactWeighted
    medianExactWeightedInterpolated medianInterpolatedWeighted medianTiming medianTimingWeighted
    medianTDigest medianTDigestWeighted medianBFloat16 medianBFloat16Weighted medianDeterministic
    medianGK medianDD
    varPop varSamp stddevPop stddevSamp varPopStable varSampStable stddevPopStable stddevSampStable
    VAR_POP VAR_SAMP STDDEV_POP STDDEV_SAMP STD STDDEV covarPop covarSamp covarPopStable
    covarSampStable COVAR_POP COVAR_SAMP corr corrStable corrMatrix covarPopMatrix covarSampMatrix
    skewPop skewSamp kurtPop kurtSamp entropy rankCorr simpleLinearRegression boundingRatio
    contingency cramersV cramersVBiasCorrected theilsU gini deltaSum deltaSumTimestamp
    intervalLengthSum exponentialMovingAverage exponentialTimeDecayedSum exponentialTimeDecayedMax
    exponentialTimeDecayedCount exponentialTimeDecayedAvg retention sequenceMatch sequenceCount
    windowFunnel sparkbar sparkBar largestTriangleThreeBuckets lttb analysisOfVariance anova
    studentTTest welchTTest mannWhitneyUTest meanZTest kolmogorovSmirnovTest singleValueOrNull
    maxIntersections maxIntersectionsPosition
    row_number rank dense_rank denseRank percent_rank percentRank cume_dist ntile lag lead lagInFrame
    leadInFrame nth_value nonNegativeDerivative
    """.split()
)

COMBINATORS = (
    "MergeState", "SimpleState", "OrDefault", "Distinct", "Resample", "ForEach", "ArgMin", "ArgMax",
    "OrNull", "State", "Merge", "Tuple", "Array", "Null", "Map", "If",
)  # fmt: skip

# The allowed names ClickHouse itself resolves regardless of case (`COUNT()`, `Sum()`, `If()`):
# a different spelling of one of these is the same function. Every other name must match exactly.
CASE_INSENSITIVE = frozenset(
    """
    _cast abs acos adddate age analysisofvariance anova any_value approx_top_count approx_top_k
    approx_top_sum array_agg array_remove array_to_string ascii asin atan atan2 avg bin bit_and
    bit_or bit_xor byteslice byteswap cardinality cast ceil ceiling char char_length
    character_length coalesce concat concat_ws corr cos count countsubstrings covar_pop
    covar_samp crc32 crc32ieee crc64 curdate current_date current_timestamp date_bin date_format
    date_trunc datediff datename day dayofmonth dayofweek dayofyear degrees dense_rank exp
    factorial first_value first_value_respect_nulls firstnondefault flatten floor format_bytes
    from_base64 from_days from_unixtime from_utc_timestamp greatest group_concat hassubsequence
    hassubsequencecaseinsensitive hassubsequencecaseinsensitiveutf8 hassubsequenceutf8
    hastokencaseinsensitive hastokencaseinsensitiveornull hex hour hypot if ifnull inet6_aton
    inet6_ntoa inet_aton inet_ntoa initcap instr isnull json_array_length kolmogorovsmirnovtest
    lag last_day last_value last_value_respect_nulls lcase lead least left length ln
    localtimestamp locate log log10 log2 lower lpad makedate makedate32 makedatetime
    makedatetime64 max max2 max_by microsecond mid midpoint millisecond min min2 min_by minute
    mod month monthname nanosecond natural_sort_key not now now64 nth_value ntile nullif
    octet_length overlay percent_rank pi pmod position positive_modulo positivemodulo
    positivemoduloornull pow power quarter radians rand rank regexp_extract regexp_instr
    regexp_matches regexp_replace regexp_substr regexpinstr repeat replace reverse right round
    row_number rpad scalarproduct second sign sin soundex space sqrt std stddev stddev_pop
    stddev_samp str_to_date str_to_map string_agg subdate substr substring substring_index sum
    tan tanh time_bucket timediff timestamp to_base64 to_days to_unixtime to_utc_timestamp today
    todecimalstring trunc truncate ucase unbin unhex unnest upper utc_timestamp utctimestamp
    var_pop var_samp week width_bucket year yearweek yyyymmddhhmmsstodatetime yyyymmddtodate
    yyyymmddtodate32
    """.split()
)

_CASE_INSENSITIVE_AGGREGATES = CASE_INSENSITIVE & {name.lower() for name in AGGREGATE_FUNCTIONS}

# Functions whose first argument names an aggregate function in a string ('median', 'sumIf').
_NAMES_AN_AGGREGATE = frozenset({"arrayReduce", "arrayReduceInRanges", "initializeAggregation"})
# The IN family: a bare name on the right (`x IN t`) is a table.
_IN_FUNCTIONS = frozenset(
    {"in", "notIn", "globalIn", "globalNotIn", "nullIn", "notNullIn", "globalNullIn", "globalNotNullIn"}
)
# Allowed scalar names that are also table functions: refused where a table function would run.
_TABLE_FUNCTION_TWINS = frozenset({"format"})

_SETTINGS_REFUSED = (
    "a SETTINGS clause: the time, memory and result limits of /admin/sql are not the query's to change"
)


def function_allowed(name: str) -> bool:
    """Whether a function of this name (as written in a query) is on the allow-list."""
    if name in SCALAR_FUNCTIONS or name in AGGREGATE_FUNCTIONS or name.lower() in CASE_INSENSITIVE:
        return True
    return _aggregate_allowed(name)


def _aggregate_allowed(name: str) -> bool:
    if name in AGGREGATE_FUNCTIONS or name.lower() in _CASE_INSENSITIVE_AGGREGATES:
        return True
    for suffix in COMBINATORS:
        if name.endswith(suffix) and len(name) > len(suffix) and _aggregate_allowed(name[: -len(suffix)]):
            return True
    return False


# -- reading the canonical text ----------------------------------------------------------------


def _mask_quoted(canonical: str) -> str:
    """The canonical text with every quoted token's content removed ('' and ``), refusing quoted
    names that could forge or blur lines of the tree dump."""
    out: list[str] = []
    i, n = 0, len(canonical)
    while i < n:
        quote = canonical[i]
        if quote not in "'`\"":
            out.append(quote)
            i += 1
            continue
        j = i + 1
        while j < n and canonical[j] != quote:
            j += 2 if canonical[j] == "\\" else 1
        if j >= n:
            raise QueryRefused(f"an unterminated quote in {canonical[i : i + 60]!r}")
        body = canonical[i + 1 : j]
        if quote != "'" and any(ch in body for ch in "\\.()"):
            raise QueryRefused(
                f"the quoted name {canonical[i : j + 1]}: names with escapes (line breaks, quotes), dots "
                "or parentheses are not accepted"
            )
        out.append(quote * 2)
        i = j + 1
    return "".join(out)


# -- reading the parse tree ----------------------------------------------------------------------


@dataclass
class _Node:
    kind: str
    name: str
    alias: str
    declared: int
    line: str
    children: list[_Node] = field(default_factory=list)


_LINE = re.compile(r"(?P<indent> *)(?P<kind>[A-Za-z_][\w:]*)(?P<rest>.*)")
_CHILDREN = re.compile(r" \(children (\d+)\)$")
_ALIAS = re.compile(r" \(alias ([^()]*)\)$")


def _parse_tree(lines: list[str]) -> _Node:
    while lines and not lines[-1].strip():
        lines = lines[:-1]
    root: _Node | None = None
    stack: list[_Node] = []
    for line in lines:
        m = _LINE.fullmatch(line)
        if m is None or len(m["indent"]) > len(stack) or (root is not None and not m["indent"]):
            raise QueryRefused(f"a query whose parse tree runcap cannot read (at {line[:120]!r})")
        rest = m["rest"]
        declared = 0
        if c := _CHILDREN.search(rest):
            declared, rest = int(c.group(1)), rest[: c.start()]
        alias = ""
        if m["kind"] != "Literal" and (a := _ALIAS.search(rest)):
            alias, rest = a.group(1), rest[: a.start()]
        if rest and not rest.startswith(" "):
            raise QueryRefused(f"a query whose parse tree runcap cannot read (at {line[:120]!r})")
        node = _Node(m["kind"], rest[1:], alias, declared, line)
        del stack[len(m["indent"]) :]
        if stack:
            stack[-1].children.append(node)
        else:
            root = node
        stack.append(node)
    if root is None:
        raise QueryRefused("a query ClickHouse returned no parse tree for")
    _check_counts(root)
    return root


def _check_counts(node: _Node) -> None:
    if len(node.children) != node.declared:
        raise QueryRefused(f"a query whose parse tree runcap cannot read (at {node.line[:120]!r})")
    for child in node.children:
        _check_counts(child)


class _Walk:
    def __init__(self, database: str) -> None:
        self.database = database

    def root(self, root: _Node) -> None:
        if root.kind == "SelectWithUnionQuery":
            body, extras = root.children[:1], root.children[1:]
            if [c.kind for c in body] != ["ExpressionList"]:
                raise QueryRefused(f"a query whose parse tree runcap cannot read (at {root.line[:120]!r})")
        elif root.kind == "DescribeQuery":
            body, extras = root.children[:1], root.children[1:]
            if [c.kind for c in body] != ["TableExpression"]:
                raise QueryRefused("a DESCRIBE of something other than a table or a subquery")
        else:
            kind = re.sub(r"Query$", "", root.kind)
            raise QueryRefused(f"the statement {kind}: /admin/sql runs one SELECT (or DESCRIBE)", READONLY)
        # The driver ends every query with `FORMAT Native`; anything else after the body is the
        # query's own INTO OUTFILE / FORMAT / SETTINGS.
        if extras and extras[-1].kind == "Identifier" and extras[-1].name == "Native":
            extras = extras[:-1]
        for extra in extras:
            if extra.kind == "Literal":
                raise QueryRefused("INTO OUTFILE: /admin/sql does not write files")
            if extra.kind == "Identifier":
                raise QueryRefused(f"FORMAT {extra.name}: /admin/sql chooses the format of its answer")
            if extra.kind == "Set":
                raise QueryRefused(_SETTINGS_REFUSED)
            raise QueryRefused(f"{extra.kind} after the query")
        for child in body:
            self.node(child, root)

    def node(self, node: _Node, parent: _Node) -> None:
        kind = node.kind
        if kind not in NODE_KINDS:
            if kind == "Set":
                raise QueryRefused(_SETTINGS_REFUSED)
            if kind == "ColumnsApplyTransformer":
                raise QueryRefused("the APPLY column transformer: call the function on the columns by name")
            if kind == "QueryParameter":
                raise QueryRefused(f"the parameter {{{node.name}}} without a value in params")
            raise QueryRefused(f"{kind} in a query")
        if kind == "Function":
            self.function(node, parent)
        elif kind == "TableIdentifier":
            self.table(node.name)
        elif kind == "Identifier":
            parts = node.name.split(".")
            if len(parts) > 2 and parts[0] != self.database:
                # `db.table.column`: ClickHouse reads that table even without a FROM
                raise QueryRefused(
                    f"the name {node.name}: a name of three or more parts must start with the "
                    f"{self.database} database"
                )
        elif kind in ("QualifiedAsterisk", "QualifiedColumnsListMatcher", "QualifiedColumnsRegexpMatcher"):
            for child in node.children:
                if child.kind == "Identifier":
                    self.table(child.name)
        for child in node.children:
            self.node(child, node)

    def function(self, node: _Node, parent: _Node) -> None:
        name = node.name
        if parent.kind == "TableExpression":
            raise QueryRefused(
                f"the table function {name}(): /admin/sql reads the tables of the {self.database} "
                "database only"
            )
        if not function_allowed(name):
            raise QueryRefused(
                f"the function {name}(): it is not on the allow-list of functions /admin/sql may call "
                "(nothing that reads files, URLs, other servers, dictionaries or the server's state)"
            )
        args = (
            node.children[0].children if node.children and node.children[0].kind == "ExpressionList" else []
        )
        if name in _NAMES_AN_AGGREGATE:
            m = re.fullmatch(r"'(\w+)'", args[0].name) if args and args[0].kind == "Literal" else None
            if m is None or not _aggregate_allowed(m.group(1)):
                named = args[0].name if args else "nothing"
                raise QueryRefused(
                    f"{name}({named}, ...): the aggregate function must be an allowed one, named in a string"
                )
        if name in _IN_FUNCTIONS and len(args) == 2:
            right = args[1]
            if right.kind == "Identifier":
                self.table(right.name)  # `x IN t` reads table t
            elif right.kind == "Function" and right.name in _TABLE_FUNCTION_TWINS:
                raise QueryRefused(f"the table function {right.name}() on the right of IN")

    def table(self, name: str) -> None:
        parts = name.split(".")
        if len(parts) == 1 or (len(parts) == 2 and parts[0] == self.database):
            return  # the reader's default database is runcap's, or a CTE
        raise QueryRefused(
            f"the table {name}: /admin/sql reads the tables of the {self.database} database only"
        )
