-- Semantics of the flat outbox that the partitioned layout may not keep (lost_semantics.py).
-- Placeholders: {rel_reg} text literal of the quoted, qualified table name.

-- name: unique-keys
-- Valid unique indexes of the table: name, primary key?, constraint kind, key columns in order (NULL for an expression), partial?, definition.
SELECT i.relname, x.indisprimary, coalesce(c.contype::text, ''),
       ARRAY(SELECT a.attname::text
             FROM unnest(x.indkey::int2[]) WITH ORDINALITY AS k(attnum, position)
             LEFT JOIN pg_attribute a ON a.attrelid = x.indrelid AND a.attnum = k.attnum
             WHERE k.position <= x.indnkeyatts
             ORDER BY k.position),
       x.indpred IS NOT NULL, pg_get_indexdef(x.indexrelid)
FROM pg_index x
JOIN pg_class i ON i.oid = x.indexrelid
LEFT JOIN pg_constraint c ON c.conindid = x.indexrelid AND c.conrelid = x.indrelid
WHERE x.indrelid = to_regclass({rel_reg}) AND x.indisunique AND x.indisvalid
ORDER BY i.relname
