"""The learned scorer inside other libraries' runtimes (kvpress: `foresight.integrations.kvpress_press`)."""
