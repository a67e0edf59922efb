//! What the caches hold and did: `SHOW CACHE` rows and the `shoal_cache_*` metrics.
