"""The ms-swift plugin file: `swift rlhf --rlhf_type grpo --external_plugins "$(pgloss swift-plugin)" --loss_type
'pgloss:<name>[,field=value,...]' ...` imports it, and ms-swift's GRPO trainer becomes pgloss's adapter
(`pgloss.integrations.swift.PGLossSwiftGRPOTrainer`). ms-swift imports it by path: it holds no relative import."""

from pgloss.integrations.swift import install

install()
