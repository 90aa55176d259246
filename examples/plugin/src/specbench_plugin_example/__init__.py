"""An example specbench method from its own package (see ``bigram``)."""
