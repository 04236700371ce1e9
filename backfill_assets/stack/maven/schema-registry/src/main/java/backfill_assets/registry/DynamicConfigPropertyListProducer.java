package backfill_assets.registry;

import io.apicurio.common.apps.config.DynamicConfigPropertyList;
import java.util.List;
import javax.enterprise.inject.Produces;
import javax.inject.Singleton;

/**
 * The bean Apicurio's config-index extension generates at build time from the properties
 * annotated {@code @Dynamic} (settings an administrator may change at run time through the
 * registry's admin API). That extension's deployment artifact is not on the Maven mirror this
 * project builds from, so the list is empty: every setting comes from configuration.
 */
public class DynamicConfigPropertyListProducer {
    @Produces
    @Singleton
    DynamicConfigPropertyList dynamicConfigPropertyList() {
        return new DynamicConfigPropertyList(List.of());
    }
}
