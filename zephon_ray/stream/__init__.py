"""The framework-free stream layer: slice sources behind one narrow protocol, and the loader core."""
