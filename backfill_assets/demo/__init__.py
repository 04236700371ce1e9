"""Demo and test producers: the polite demo generator and the hostile one."""
