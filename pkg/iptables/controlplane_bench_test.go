package iptables_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/iptables"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/iptables/iptablestest"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/metrics"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
	"github.com/ip-masq-agent/ip-masq-agent/test/e2e"
)

// foreignRules is the size of the nat table the control plane is measured against: kube-proxy's
// iptables mode on a node of a large cluster.
const foreignRules = 20_000

// nsRunner runs the tools inside a namespace the way the agent runs them in the node's: started
// directly (from a thread that entered the namespace), not through `ip netns exec`, which adds a
// process and a mount namespace to every command. It counts the runs.
type nsRunner struct {
	ns   string
	runs atomic.Int64
}

func (r *nsRunner) LookPath(name string) error { return iptables.ExecRunner{}.LookPath(name) }

func (r *nsRunner) Run(ctx context.Context, stdin []byte, name string, args ...string) (out []byte, err error) {
	r.runs.Add(1)
	if nsErr := testutil.Do(r.ns, func() error {
		out, err = iptables.ExecRunner{}.Run(ctx, stdin, name, args...)
		return nil
	}); nsErr != nil {
		return nil, nsErr
	}
	return out, err
}

// BenchmarkControlPlane: what the iptables backend costs on a node whose nat table holds
// kube-proxy's 20,000 rules, in each iptables mode: a /metrics scrape (the rule counters), a
// drift check, an apply that finds the chain as wanted, and one that changes it. commands/op is
// the iptables tools run per operation. The default policy (three rules), IPv4 only.
func BenchmarkControlPlane(b *testing.B) {
	for _, mode := range []iptables.Mode{iptables.ModeNFT, iptables.ModeLegacy} {
		b.Run("mode="+string(mode), func(b *testing.B) {
			testutil.RequirePrivileged(b, "ip", "iptables-"+string(mode)+"-restore")
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
			defer cancel()
			ns := testutil.NewNetns(b)
			if _, err := e2e.NSExec(ctx, ns, string(iptablestest.KubeProxyNAT(foreignRules)), "iptables-"+string(mode)+"-restore", "--noflush"); err != nil {
				b.Fatalf("load kube-proxy's rules: %v", err)
			}
			runner := &nsRunner{ns: ns}
			be, err := iptables.New(ctx, iptables.Options{Runner: runner, Mode: mode})
			if err != nil {
				b.Fatal(err)
			}
			defaults := policy.Compile(config.Default(config.Options{}), policy.Options{RandomFully: true})
			other := policy.Compile(config.Default(config.Options{}), policy.Options{RandomFully: true, ToPorts: policy.PortRanges{{First: 20000, Last: 30000}}})
			if err := be.Apply(ctx, defaults); err != nil {
				b.Fatal(err)
			}
			reg, err := metrics.NewRegistry(metrics.Options{Backend: be})
			if err != nil {
				b.Fatal(err)
			}
			handler := metrics.Handler(reg, nil)

			measure := func(name string, op func(i int)) {
				b.Run(name, func(b *testing.B) {
					runs := runner.runs.Load()
					for i := range b.N {
						op(i)
					}
					b.ReportMetric(float64(runner.runs.Load()-runs)/float64(b.N), "commands/op")
				})
			}
			measure("scrape", func(int) {
				rec := httptest.NewRecorder()
				handler.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
				if rec.Code != http.StatusOK || !strings.Contains(rec.Body.String(), metrics.RulePackets) {
					b.Fatalf("scrape: %d without rule counters:\n%s", rec.Code, rec.Body)
				}
			})
			measure("drift", func(int) {
				if drift, err := be.CheckDrift(ctx); err != nil || len(drift) > 0 {
					b.Fatalf("drift check: %q %v", drift, err)
				}
			})
			measure("apply-unchanged", func(int) {
				if err := be.Apply(ctx, defaults); err != nil {
					b.Fatal(err)
				}
			})
			measure("apply-changed", func(i int) {
				p := other
				if i%2 == 1 {
					p = defaults
				}
				if err := be.Apply(ctx, p); err != nil {
					b.Fatal(err)
				}
			})
		})
	}
}
