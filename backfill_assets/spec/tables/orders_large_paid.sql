-- Paid order events of 500.00 or more (amounts are in minor units): a filter over the events.
SELECT
  e.event_id,
  e.order_id,
  e.customer_id,
  e.amount_minor,
  e.currency,
  e.event_time
FROM orders AS e
WHERE e.event_time >= {start} AND e.event_time < {end}
  AND e.status = 'paid'
  AND e.amount_minor >= 50000
