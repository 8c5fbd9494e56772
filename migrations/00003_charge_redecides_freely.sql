-- +goose Up

-- txlimit_charge, as in 00001, except that when both candidate rows are locked (fixed_charge 3) the
-- choice on their latest levels is as free as on the lock-free read: the fuller row alone when it
-- holds count. In 00001 a decision that had planned to combine two shards kept combining them when
-- their latest levels (under READ COMMITTED, after a concurrent Credit say) showed that one alone
-- could serve, splitting the count between them against the rule; it never over-granted.
-- With fixed_charge 1 or 2 only that row is locked, so it stays charged.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION txlimit_charge(lv_a double precision, lv_b double precision, two boolean,
                                          count double precision, fixed_charge integer)
RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT CASE WHEN NOT two THEN 1
                WHEN fixed_charge IN (1, 2) THEN fixed_charge
                WHEN greatest(lv_a, lv_b) >= count THEN CASE WHEN lv_a >= lv_b THEN 1 ELSE 2 END
                WHEN abs(lv_a - lv_b) <= count THEN 3
                WHEN lv_a >= lv_b THEN 1
                ELSE 2
           END
$$;
-- +goose StatementEnd

-- +goose Down
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION txlimit_charge(lv_a double precision, lv_b double precision, two boolean,
                                          count double precision, fixed_charge integer)
RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT CASE WHEN NOT two THEN 1
                WHEN fixed_charge IN (1, 2) THEN fixed_charge
                WHEN fixed_charge = 0 AND greatest(lv_a, lv_b) >= count THEN CASE WHEN lv_a >= lv_b THEN 1 ELSE 2 END
                WHEN abs(lv_a - lv_b) <= count THEN 3
                WHEN lv_a >= lv_b THEN 1
                ELSE 2
           END
$$;
-- +goose StatementEnd
