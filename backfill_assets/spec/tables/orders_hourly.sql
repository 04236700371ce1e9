-- Events, orders and amount per event-time hour and currency.
SELECT
  date_trunc('HOUR', event_time)           AS event_hour,
  currency,
  count(*)                                 AS events,
  count(DISTINCT order_id)                 AS orders,
  CAST(sum(amount_minor) AS BIGINT)        AS amount_minor,
  count_if(event_type = 'cancelled')       AS cancelled
FROM orders
WHERE event_time >= {start} AND event_time < {end}
GROUP BY date_trunc('HOUR', event_time), currency
