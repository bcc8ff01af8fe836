package bench

import (
	"context"
	"testing"

	"github.com/ip-masq-agent/ip-masq-agent/test/e2e"
)

// extraModes are the modes beyond the limit and iptables.
func extraModes() []Mode { return nil }

// natFiller returns, for a mode with a NAT table, a function that fills it with many entries and
// returns how many it holds; nil for modes without one.
func natFiller(Mode) func(ctx context.Context, b *testing.B, e *e2e.Env) int { return nil }
