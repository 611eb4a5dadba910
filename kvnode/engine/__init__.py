"""The engine: scheduler, engine step, async engine, sampler, and the connector to the tiers."""
