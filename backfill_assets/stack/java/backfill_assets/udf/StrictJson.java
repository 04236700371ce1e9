package backfill_assets.udf;

import com.fasterxml.jackson.core.JsonFactory;
import com.fasterxml.jackson.core.JsonParser;
import com.fasterxml.jackson.core.JsonToken;
import com.fasterxml.jackson.core.StreamReadFeature;
import java.io.IOException;
import java.math.BigDecimal;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import org.apache.spark.sql.Row;
import org.apache.spark.sql.RowFactory;
import org.apache.spark.sql.api.java.UDF2;

/**
 * The raw parse's strict JSON reader: one streaming pass over a Kafka value that says whether it
 * is exactly one JSON value, whether that value is an object, and reads the requested fields
 * with no coercion.
 *
 * <p>Called as {@code strict_json(value_as_string, request)}. The request names one field per
 * line, {@code <path>\t<type>}, where the path is {@code $.a} or {@code $.a.b} and the type one of
 * {@code string}, {@code boolean}, {@code bigint}, {@code int}, {@code double},
 * {@code decimal(p,s)} or {@code present}. The result is a row {@code (whole, object, f0, f1, ...)}:
 *
 * <ul>
 *   <li>{@code whole}: the text is one JSON value and nothing else but whitespace (no trailing
 *       data, no duplicate names in any object, nesting within Jackson's limit, no byte-order
 *       mark). When false, every other field is NULL.
 *   <li>{@code object}: the value is a JSON object.
 *   <li>{@code fN}: the field's value when its JSON kind is the type's kind and it converts without
 *       loss (strings only from strings, booleans only from {@code true}/{@code false}, integers
 *       and decimals only from numbers whose exact value fits, doubles from finite numbers);
 *       otherwise NULL. {@code present} is true when the field exists, whatever its value.
 * </ul>
 *
 * <p>A NULL value (a tombstone) gives a NULL row. The parser is Jackson with Spark's defaults
 * (the same limits {@code parse_json} has) plus duplicate detection. Nothing here is stateful
 * across rows except the parsed request, which is immutable.
 */
public final class StrictJson implements UDF2<String, String, Row> {
  private static final long serialVersionUID = 1L;
  private static final JsonFactory FACTORY =
      JsonFactory.builder().enable(StreamReadFeature.STRICT_DUPLICATE_DETECTION).build();

  private static final int STRING = 0;
  private static final int BOOLEAN = 1;
  private static final int BIGINT = 2;
  private static final int INT = 3;
  private static final int DOUBLE = 4;
  private static final int DECIMAL = 5;
  private static final int PRESENT = 6;

  /** A node of the requested paths: the slots read at this path and the names below it. */
  private static final class Node {
    final Map<String, Node> children = new HashMap<>();
    final List<int[]> slots = new ArrayList<>(); // {slot index, kind, precision, scale}
  }

  /** A parsed request: the tree of paths and the number of slots. */
  private static final class Plan {
    final String text;
    final Node root = new Node();
    int size;

    Plan(String text) {
      this.text = text;
      for (String line : text.split("\n")) {
        if (line.isEmpty()) {
          continue;
        }
        int tab = line.indexOf('\t');
        if (tab < 0 || !line.startsWith("$.")) {
          throw new IllegalArgumentException("strict_json: bad request line " + line);
        }
        Node node = root;
        for (String name : line.substring(2, tab).split("\\.", -1)) {
          node = node.children.computeIfAbsent(name, k -> new Node());
        }
        node.slots.add(slot(size++, line.substring(tab + 1)));
      }
    }

    private static int[] slot(int index, String type) {
      switch (type) {
        case "string":
          return new int[] {index, STRING, 0, 0};
        case "boolean":
          return new int[] {index, BOOLEAN, 0, 0};
        case "bigint":
          return new int[] {index, BIGINT, 0, 0};
        case "int":
          return new int[] {index, INT, 0, 0};
        case "double":
          return new int[] {index, DOUBLE, 0, 0};
        case "present":
          return new int[] {index, PRESENT, 0, 0};
        default:
          if (type.startsWith("decimal(") && type.endsWith(")")) {
            String[] ps = type.substring(8, type.length() - 1).split(",");
            return new int[] {
              index, DECIMAL, Integer.parseInt(ps[0].trim()), Integer.parseInt(ps[1].trim())
            };
          }
          throw new IllegalArgumentException("strict_json: unsupported type " + type);
      }
    }
  }

  private transient volatile Plan plan;

  @Override
  public Row call(String value, String request) throws Exception {
    if (value == null) {
      return null;
    }
    Plan p = plan;
    if (p == null || !p.text.equals(request)) {
      p = new Plan(request);
      plan = p;
    }
    Object[] out = new Object[p.size + 2];
    out[0] = Boolean.FALSE;
    if (!value.isEmpty() && value.charAt(0) == '\uFEFF') {
      return RowFactory.create(out);
    }
    try (JsonParser parser = FACTORY.createParser(value)) {
      JsonToken first = parser.nextToken();
      if (first == null) {
        return RowFactory.create(out);
      }
      read(parser, first, p.root, out);
      if (parser.nextToken() != null) {
        return invalid(p);
      }
      out[0] = Boolean.TRUE;
      out[1] = first == JsonToken.START_OBJECT;
      return RowFactory.create(out);
    } catch (IOException | RuntimeException e) {
      return invalid(p);
    }
  }

  private static Row invalid(Plan p) {
    Object[] out = new Object[p.size + 2];
    out[0] = Boolean.FALSE;
    return RowFactory.create(out);
  }

  /** Reads the value starting at {@code token}; {@code node} is the request at this path. */
  private static void read(JsonParser parser, JsonToken token, Node node, Object[] out)
      throws IOException {
    if (node != null) {
      for (int[] slot : node.slots) {
        out[slot[0] + 2] = convert(parser, token, slot);
      }
    }
    if (token == JsonToken.START_OBJECT) {
      if (node == null || node.children.isEmpty()) {
        parser.skipChildren();
        return;
      }
      for (JsonToken t = parser.nextToken(); t != JsonToken.END_OBJECT; t = parser.nextToken()) {
        Node child = node.children.get(parser.currentName());
        read(parser, parser.nextToken(), child, out);
      }
    } else if (token == JsonToken.START_ARRAY) {
      parser.skipChildren();
    }
  }

  private static Object convert(JsonParser parser, JsonToken token, int[] slot)
      throws IOException {
    switch (slot[1]) {
      case PRESENT:
        return Boolean.TRUE;
      case STRING:
        return token == JsonToken.VALUE_STRING ? parser.getText() : null;
      case BOOLEAN:
        if (token == JsonToken.VALUE_TRUE) {
          return Boolean.TRUE;
        }
        return token == JsonToken.VALUE_FALSE ? Boolean.FALSE : null;
      case DOUBLE:
        if (token != JsonToken.VALUE_NUMBER_INT && token != JsonToken.VALUE_NUMBER_FLOAT) {
          return null;
        }
        double d = parser.getDoubleValue();
        return Double.isFinite(d) ? d : null;
      case BIGINT:
      case INT:
        {
          Long whole = integral(parser, token);
          if (whole == null) {
            return null;
          }
          if (slot[1] == BIGINT) {
            return whole;
          }
          long w = whole;
          return w == (int) w ? Integer.valueOf((int) w) : null;
        }
      case DECIMAL:
        return decimal(parser, token, slot[2], slot[3]);
      default:
        return null;
    }
  }

  /** The number's exact value as a long, or null if it has a fraction or does not fit. */
  private static Long integral(JsonParser parser, JsonToken token) throws IOException {
    if (token == JsonToken.VALUE_NUMBER_INT) {
      JsonParser.NumberType type = parser.getNumberType();
      if (type == JsonParser.NumberType.INT || type == JsonParser.NumberType.LONG) {
        return parser.getLongValue();
      }
      return null; // a BigInteger: beyond a long
    }
    if (token != JsonToken.VALUE_NUMBER_FLOAT) {
      return null;
    }
    BigDecimal exact = parser.getDecimalValue().stripTrailingZeros();
    if (exact.scale() > 0 || exact.precision() - exact.scale() > 19) {
      return null;
    }
    try {
      return exact.longValueExact();
    } catch (ArithmeticException e) {
      return null;
    }
  }

  /** The number as decimal(precision, scale) when it has at most that many digits. */
  private static BigDecimal decimal(JsonParser parser, JsonToken token, int precision, int scale)
      throws IOException {
    if (token != JsonToken.VALUE_NUMBER_INT && token != JsonToken.VALUE_NUMBER_FLOAT) {
      return null;
    }
    BigDecimal exact = parser.getDecimalValue();
    BigDecimal stripped = exact.signum() == 0 ? BigDecimal.ZERO : exact.stripTrailingZeros();
    if (stripped.scale() > scale || stripped.precision() - stripped.scale() > precision - scale) {
      return null;
    }
    return stripped.setScale(scale);
  }
}
