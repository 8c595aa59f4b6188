"""Where the workers of a job are: cluster resolvers and TF_CONFIG."""
