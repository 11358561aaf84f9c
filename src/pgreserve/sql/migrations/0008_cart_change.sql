-- Changing a held cart (change_v1, sql/functions/change.sql).
--
-- A change never rewrites the quantity of a line whose units it gives back in
-- part: that line's number gets its one restore record (stock_movement, reason
-- 'changed') and the units kept move to a line with a new number, so
-- stock_movement_restore_once and stock_movement_sale_once keep meaning "at
-- most once per line". A removed line leaves the cart with its restore record;
-- a raised line keeps its number (nothing of it was restored). Line numbers
-- therefore grow over a reservation's changes: the cart still has at most 100
-- lines (the callers check it), numbered anywhere in smallint's positive range.
-- NOT VALID, then VALIDATE: the check of existing rows takes no lock that stops
-- writes.
ALTER TABLE reservation_line
    ADD CONSTRAINT reservation_line_line_no_positive CHECK (line_no >= 1) NOT VALID;
ALTER TABLE reservation_line VALIDATE CONSTRAINT reservation_line_line_no_positive;
ALTER TABLE reservation_line DROP CONSTRAINT reservation_line_line_no_check;

-- The event a change writes, with the reservation as it is afterwards.
ALTER TABLE outbox_event
    ADD CONSTRAINT outbox_event_type_known CHECK (type IN (
        'reservation.created', 'reservation.claimed', 'reservation.released',
        'reservation.expired', 'reservation.changed', 'stock.changed')) NOT VALID;
ALTER TABLE outbox_event VALIDATE CONSTRAINT outbox_event_type_known;
ALTER TABLE outbox_event DROP CONSTRAINT outbox_event_type_check;
