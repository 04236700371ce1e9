package backfill_assets.udf;

import com.google.protobuf.CodedInputStream;
import com.google.protobuf.DescriptorProtos.FileDescriptorProto;
import com.google.protobuf.Descriptors.Descriptor;
import com.google.protobuf.Descriptors.DescriptorValidationException;
import com.google.protobuf.Descriptors.FieldDescriptor;
import com.google.protobuf.Descriptors.FileDescriptor;
import com.google.protobuf.DynamicMessage;
import com.google.protobuf.InvalidProtocolBufferException;
import com.google.protobuf.Message;
import com.google.protobuf.Timestamp;
import java.io.IOException;
import java.util.ArrayList;
import java.util.Base64;
import java.util.List;
import java.util.concurrent.ConcurrentHashMap;
import org.apache.spark.sql.Row;
import org.apache.spark.sql.RowFactory;
import org.apache.spark.sql.api.java.UDF3;

/**
 * The raw parse's protobuf decode: one Kafka value in Confluent's wire format (magic byte 0, the
 * 4-byte schema id, the message-index path as zig-zag varints, the protobuf payload), read with
 * protobuf-java's {@code DynamicMessage} against its writer schema.
 *
 * <p>Called as {@code protobuf_row(value, descriptor, request)}: {@code descriptor} is the writer
 * schema as a base64 {@code FileDescriptorProto} with no imports (the registry's
 * {@code format=serialized} answer); {@code request} is the message's full name on its first line,
 * then one column per line, {@code <field name>\t<kind>}, kind one of {@code string},
 * {@code bigint}, {@code int}, {@code double}, {@code boolean} or {@code timestamp} (epoch
 * microseconds, as a long, from an int64 of epoch milliseconds or a
 * {@code google.protobuf.Timestamp}). The writer schema may import
 * {@code google/protobuf/timestamp.proto} and no other file. The result is a row
 * {@code (status, c0, c1, ...)}:
 *
 * <ul>
 *   <li>{@code status}: 0 decoded; 1 the index path names another message of the schema (or none);
 *       2 the bytes are not a value of the message (header, index path or payload).
 *   <li>{@code cN}: the field's value, NULL when the writer schema has no such field or the field
 *       tracks presence and is unset; an unset proto3 scalar without presence is its zero value,
 *       as protobuf defines it. Integers widen to {@code bigint}, floats to {@code double}.
 * </ul>
 *
 * <p>Which field types may be read as which kind was judged on the driver
 * (backfill_assets/lake/decode/protobuf.py) before this is called. A NULL value (a tombstone) gives a
 * NULL row. What a (descriptor, request) resolves to is cached, and each thread keeps its last one;
 * nothing else is stateful.
 */
public final class ProtobufRow implements UDF3<byte[], String, String, Row> {
  private static final long serialVersionUID = 1L;
  private static final FileDescriptor TIMESTAMP = Timestamp.getDescriptor().getFile();
  // The last (descriptor, request) this thread read and what it resolved to: a window's values
  // come in runs of one schema id, so the common case is one equals() per row.
  private static final ThreadLocal<Plan> LAST = new ThreadLocal<>();
  private static final ConcurrentHashMap<String, Plan> PLANS = new ConcurrentHashMap<>();

  /** What one (descriptor, request) resolves to: the message, and per column its field (NULL if
   * the writer schema has none, or it is repeated) and kind. Immutable. */
  private static final class Plan {
    final String descriptor;
    final String request;
    final Descriptor message;
    final FieldDescriptor[] fields;
    final String[] kinds;

    Plan(String descriptor, String request) {
      this.descriptor = descriptor;
      this.request = request;
      String[] lines = request.split("\n", -1);
      this.message = load(descriptor, lines[0]);
      this.fields = new FieldDescriptor[lines.length - 1];
      this.kinds = new String[lines.length - 1];
      for (int i = 1; i < lines.length; i++) {
        int tab = lines[i].indexOf('\t');
        FieldDescriptor field = message.findFieldByName(lines[i].substring(0, tab));
        fields[i - 1] = field == null || field.isRepeated() ? null : field;
        kinds[i - 1] = lines[i].substring(tab + 1);
      }
    }
  }

  private static Plan plan(String descriptor, String request) {
    Plan last = LAST.get();
    if (last != null && last.descriptor.equals(descriptor) && last.request.equals(request)) {
      return last;
    }
    Plan found = PLANS.computeIfAbsent(request + "\n\n" + descriptor, k -> new Plan(descriptor, request));
    LAST.set(found);
    return found;
  }

  @Override
  public Row call(byte[] value, String descriptor, String request) throws Exception {
    if (value == null) {
      return null;
    }
    Plan plan = plan(descriptor, request);
    Descriptor message = plan.message;
    int columns = plan.fields.length;
    Object[] out = new Object[columns + 1];
    if (value.length < 6 || value[0] != 0) {
      out[0] = 2;
      return RowFactory.create(out);
    }
    CodedInputStream in = CodedInputStream.newInstance(value, 5, value.length - 5);
    List<Integer> path = new ArrayList<>(2);
    DynamicMessage parsed;
    try {
      int count = in.readSInt32();
      if (count < 0 || count > 64) {
        out[0] = 2;
        return RowFactory.create(out);
      }
      if (count == 0) {
        path.add(0);
      }
      for (int i = 0; i < count; i++) {
        path.add(in.readSInt32());
      }
      if (!message.equals(at(message.getFile(), path))) {
        out[0] = 1;
        return RowFactory.create(out);
      }
      parsed = DynamicMessage.parseFrom(message, in);
    } catch (IOException | RuntimeException e) {
      out[0] = 2;
      return RowFactory.create(out);
    }
    out[0] = 0;
    for (int i = 0; i < columns; i++) {
      FieldDescriptor field = plan.fields[i];
      if (field == null || (field.hasPresence() && !parsed.hasField(field))) {
        continue;
      }
      out[i + 1] = convert(parsed.getField(field), plan.kinds[i]);
    }
    return RowFactory.create(out);
  }

  private static Object convert(Object v, String kind) {
    switch (kind) {
      case "bigint":
        return v instanceof Integer ? Long.valueOf((Integer) v) : v;
      case "double":
        return v instanceof Float ? Double.valueOf((Float) v) : v;
      case "timestamp":
        return micros(v);
      default:
        return v;
    }
  }

  /** Epoch microseconds of an int64 of epoch milliseconds or a Timestamp message (NULL if they
   * do not fit a long). */
  private static Long micros(Object v) {
    try {
      if (v instanceof Long) {
        return Math.multiplyExact((Long) v, 1000L);
      }
      Message m = (Message) v;
      Descriptor d = m.getDescriptorForType();
      long seconds = (Long) m.getField(d.findFieldByName("seconds"));
      int nanos = (Integer) m.getField(d.findFieldByName("nanos"));
      return Math.addExact(Math.multiplyExact(seconds, 1_000_000L), nanos / 1000);
    } catch (ArithmeticException e) {
      return null;
    }
  }

  /** The message at an index path of the file, or null if the path names none. */
  private static Descriptor at(FileDescriptor file, List<Integer> path) {
    List<Descriptor> level = file.getMessageTypes();
    Descriptor found = null;
    for (int index : path) {
      if (index < 0 || index >= level.size()) {
        return null;
      }
      found = level.get(index);
      level = found.getNestedTypes();
    }
    return found;
  }

  private static Descriptor find(List<Descriptor> level, String name) {
    for (Descriptor d : level) {
      Descriptor found = d.getFullName().equals(name) ? d : find(d.getNestedTypes(), name);
      if (found != null) {
        return found;
      }
    }
    return null;
  }

  private static Descriptor load(String descriptor, String name) {
    try {
      FileDescriptorProto proto = FileDescriptorProto.parseFrom(Base64.getDecoder().decode(descriptor));
      FileDescriptor[] imports = new FileDescriptor[proto.getDependencyCount()];
      for (int i = 0; i < imports.length; i++) {
        if (!proto.getDependency(i).equals(TIMESTAMP.getName())) {
          throw new IllegalArgumentException("unsupported import " + proto.getDependency(i));
        }
        imports[i] = TIMESTAMP;
      }
      FileDescriptor file = FileDescriptor.buildFrom(proto, imports);
      Descriptor message = find(file.getMessageTypes(), name);
      if (message == null || !message.getFullName().equals(name)) {
        throw new IllegalArgumentException("no message " + name + " in the writer schema");
      }
      return message;
    } catch (InvalidProtocolBufferException | DescriptorValidationException e) {
      throw new IllegalArgumentException("the writer schema is not a descriptor: " + e, e);
    }
  }
}
