-- 0003: span events. A span's `events` are the moments inside it worth their own timestamp (a
-- policy's verdict on a tool call, an approval asked for and decided), exported over OTLP as span
-- events and kept here so ClickHouse answers the same questions: one element per event,
-- `(name, at, attributes)`, in time order. Empty for most spans (an empty Array costs one byte of
-- offsets per row before compression). ZSTD(3) as for `attributes`: the same kind of text.

ALTER TABLE {database:Identifier}.spans
    ADD COLUMN IF NOT EXISTS events Array(Tuple(name String, at DateTime64(6, 'UTC'), attributes Map(String, String)))
    CODEC(ZSTD(3));
