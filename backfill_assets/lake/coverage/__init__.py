"""Coverage: what the Kafka log holds that main has not published, and hours that provably
hold nothing."""
