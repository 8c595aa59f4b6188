"""The runtime every layer stands on: values, replica contexts, meeting, replica threads."""
