"""The ghost engine's reading of jaxprs: JAX's internals, the walk and the sites."""
