package backfill_assets_tests;

import java.io.IOException;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.nio.file.Paths;
import java.util.Map;
import org.apache.kafka.clients.producer.ProducerInterceptor;
import org.apache.kafka.clients.producer.ProducerRecord;
import org.apache.kafka.clients.producer.RecordMetadata;

/**
 * Test only (the cdc tier): a producer clock the test moves. Each record's Kafka timestamp is
 * the time the producer would have given it (the record's own, or now) plus the milliseconds
 * written in the file {@code backfill.test.clock.file}, read at every record. Kafka Connect
 * stamps a Debezium record with its worker's clock; a Kafka-time hour can be backfilled only
 * once it has ended, so the tier runs each phase's changes in an hour of the past, as a worker
 * whose clock runs behind would. Nothing else of the record changes.
 */
public final class TestClock<K, V> implements ProducerInterceptor<K, V> {
  public static final String FILE = "backfill.test.clock.file";
  private Path file;

  @Override
  public void configure(Map<String, ?> configs) {
    Object name = configs.get(FILE);
    if (name == null) {
      throw new IllegalArgumentException(FILE + " is not set");
    }
    file = Paths.get(name.toString());
  }

  private long shift() {
    try {
      return Long.parseLong(new String(Files.readAllBytes(file), StandardCharsets.UTF_8).trim());
    } catch (IOException | NumberFormatException e) {
      throw new IllegalStateException("cannot read the test clock " + file, e);
    }
  }

  @Override
  public ProducerRecord<K, V> onSend(ProducerRecord<K, V> record) {
    long base = record.timestamp() != null ? record.timestamp() : System.currentTimeMillis();
    return new ProducerRecord<>(
        record.topic(), record.partition(), base + shift(), record.key(), record.value(),
        record.headers());
  }

  @Override
  public void onAcknowledgement(RecordMetadata metadata, Exception exception) {}

  @Override
  public void close() {}
}
