"""Applied by the plugin only when the CPU platform is selected (`VERL_PLATFORM=cpu`)."""
