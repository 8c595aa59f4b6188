"""The runtime every layer stands on: values, replica contexts, rendezvous, replica threads."""
