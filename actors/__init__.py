"""Ray actor classes: EngineCoreActor, RegistryActor and the stats coordinator."""
