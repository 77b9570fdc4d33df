"""Model families (config + canonical weight names) and checkpoint loading."""
