"""The Ray Data jobs around the lanes: pre-tokenisation and materialisation."""
