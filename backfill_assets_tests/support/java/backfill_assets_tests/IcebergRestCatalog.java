package backfill_assets_tests;

import jakarta.servlet.DispatcherType;
import jakarta.servlet.Filter;
import jakarta.servlet.FilterChain;
import jakarta.servlet.ServletException;
import jakarta.servlet.ServletRequest;
import jakarta.servlet.ServletResponse;
import jakarta.servlet.http.HttpServletRequest;
import jakarta.servlet.http.HttpServletResponse;
import java.io.IOException;
import java.nio.charset.StandardCharsets;
import java.security.MessageDigest;
import java.util.EnumSet;
import java.util.HashMap;
import java.util.Map;
import org.apache.iceberg.CatalogUtil;
import org.apache.iceberg.catalog.Catalog;
import org.apache.iceberg.rest.RESTCatalogAdapter;
import org.apache.iceberg.rest.RESTCatalogServlet;
import org.eclipse.jetty.ee10.servlet.FilterHolder;
import org.eclipse.jetty.ee10.servlet.ServletContextHandler;
import org.eclipse.jetty.ee10.servlet.ServletHolder;
import org.eclipse.jetty.server.Server;
import org.eclipse.jetty.server.ServerConnector;

/**
 * A real Iceberg REST catalog on 127.0.0.1 that requires a bearer token: Iceberg's own REST
 * server code (RESTCatalogAdapter and RESTCatalogServlet from iceberg-core's test fixtures, what
 * Iceberg's RESTCatalogServer fixture serves) over a JdbcCatalog on SQLite, in Jetty, behind a
 * filter of ours. Iceberg's fixture checks no Authorization header and its token endpoint
 * accepts any client secret, so the filter (1) answers POST /v1/oauth/tokens itself: the
 * client_credentials grant with the right client id and secret gets the token, anything else
 * 401; (2) lets any other request through only with "Authorization: Bearer TOKEN".
 *
 * <p>Configured by environment variables only (secrets never on the command line): REST_PORT,
 * REST_WAREHOUSE, REST_JDBC_URI, REST_TOKEN (the bearer token it requires), REST_CREDENTIAL
 * (CLIENT_ID:CLIENT_SECRET the token endpoint accepts).
 */
public final class IcebergRestCatalog {
  private IcebergRestCatalog() {}

  public static void main(String[] args) throws Exception {
    Map<String, String> props = new HashMap<>();
    props.put("catalog-impl", "org.apache.iceberg.jdbc.JdbcCatalog");
    props.put("uri", System.getenv("REST_JDBC_URI"));
    props.put("jdbc.schema-version", "V1");
    props.put("warehouse", System.getenv("REST_WAREHOUSE"));
    Catalog backend =
        CatalogUtil.buildIcebergCatalog(
            "rest_backend", props, new org.apache.hadoop.conf.Configuration());
    ServletContextHandler context = new ServletContextHandler(ServletContextHandler.NO_SESSIONS);
    context.addServlet(new ServletHolder(new RESTCatalogServlet(new RESTCatalogAdapter(backend))), "/*");
    Filter auth = new TokenFilter(System.getenv("REST_TOKEN"), System.getenv("REST_CREDENTIAL"));
    context.addFilter(new FilterHolder(auth), "/*", EnumSet.of(DispatcherType.REQUEST));
    Server server = new Server();
    ServerConnector connector = new ServerConnector(server);
    connector.setHost("127.0.0.1");
    connector.setPort(Integer.parseInt(System.getenv("REST_PORT")));
    server.addConnector(connector);
    server.setHandler(context);
    server.start();
    System.out.println("iceberg rest catalog listening on 127.0.0.1:" + connector.getLocalPort());
    server.join();
  }

  /** The token check in front of Iceberg's servlet. */
  static final class TokenFilter implements Filter {
    private final String token;
    private final String credential;

    TokenFilter(String token, String credential) {
      this.token = token;
      this.credential = credential;
    }

    @Override
    public void doFilter(ServletRequest req, ServletResponse resp, FilterChain chain)
        throws IOException, ServletException {
      HttpServletRequest request = (HttpServletRequest) req;
      HttpServletResponse response = (HttpServletResponse) resp;
      if (request.getRequestURI().endsWith("/v1/oauth/tokens")) {
        issue(request, response);
        return;
      }
      String header = request.getHeader("Authorization");
      if (header == null || !same(header, "Bearer " + token)) {
        deny(response, "NotAuthorizedException", "a valid bearer token is required");
        return;
      }
      chain.doFilter(req, resp);
    }

    private void issue(HttpServletRequest request, HttpServletResponse response)
        throws IOException {
      String given = request.getParameter("client_id") + ":" + request.getParameter("client_secret");
      if (!"client_credentials".equals(request.getParameter("grant_type"))
          || credential == null
          || !same(given, credential)) {
        response.setStatus(401);
        response.setContentType("application/json");
        response.getWriter().write("{\"error\":\"invalid_client\",\"error_description\":\"wrong client id or secret\"}");
        return;
      }
      response.setContentType("application/json");
      response.getWriter()
          .write(
              "{\"access_token\":\""
                  + token
                  + "\",\"token_type\":\"bearer\",\"expires_in\":3600,"
                  + "\"issued_token_type\":\"urn:ietf:params:oauth:token-type:access_token\"}");
    }

    private static void deny(HttpServletResponse response, String type, String message)
        throws IOException {
      response.setStatus(401);
      response.setContentType("application/json");
      response.getWriter()
          .write(
              "{\"error\":{\"message\":\""
                  + message
                  + "\",\"type\":\""
                  + type
                  + "\",\"code\":401}}");
    }

    private static boolean same(String a, String b) {
      return MessageDigest.isEqual(
          a.getBytes(StandardCharsets.UTF_8), b.getBytes(StandardCharsets.UTF_8));
    }
  }
}
