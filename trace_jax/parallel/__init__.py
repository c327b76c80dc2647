"""Device meshes, logical-axis sharding rules and multi-host initialisation."""
