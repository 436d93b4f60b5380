-- Room on each page for a record's completion. A completion rewrites the row
-- (state, outcome, result) without touching an indexed column, and PostgreSQL
-- then keeps the new version on the same page with no new index entries (a
-- HOT update) — but only if the page has room. At the default fill factor
-- of 100 the page a claim just filled usually has none, and every completion
-- became a new tuple elsewhere plus an entry in both indexes. Applies to pages
-- written from now on; existing pages fill as before.
ALTER TABLE idem_records SET (fillfactor = 80);
