package cli

import (
	"bytes"
	"context"
	"crypto/rand"
	"strings"
	"testing"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/agent"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/nodelock"
)

// holdLock takes a node lock of the test's own, as command, and returns the context that makes
// explain and dump ask it.
func holdLock(t *testing.T, command string) (*nodelock.Lock, context.Context) {
	t.Helper()
	name := "ip-masq-agent-test-" + rand.Text()
	l, err := nodelock.TryAcquire(name, nodelock.Me(command, "test"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Release() })
	return l, context.WithValue(context.Background(), lockNameKey{}, name)
}

func runIn(ctx context.Context, args ...string) (string, string, error) {
	var out, errOut bytes.Buffer
	err := Run(ctx, args, &out, &errOut)
	return out.String(), errOut.String(), err
}

// explain decides by the configuration the running agent applied, which it says, and by the
// file where no agent answers or --from-file asks for it.
func TestExplainReadsTheRunningAgent(t *testing.T) {
	file := writeConfig(t, "nonMasqueradeCIDRs: [10.0.0.0/8]\n") // 8.8.8.8 masqueraded
	const live = "nonMasqueradeCIDRs: [8.8.8.0/24]\nmasqueradeCIDRs: [8.8.8.8/32]\n"
	cfg, err := config.Parse([]byte(live), config.Options{})
	if err != nil {
		t.Fatal(err)
	}
	verdict := func(t *testing.T, ctx context.Context, args ...string) (string, string) {
		t.Helper()
		out, stderr, err := runIn(ctx, append([]string{"explain", "--config=" + file, "8.8.8.8", "8.8.8.9"}, args...)...)
		if err != nil {
			t.Fatalf("explain: %v\n%s%s", err, out, stderr)
		}
		rows := explainRows(out)
		which, ok := strings.CutPrefix(stderr, "config: ")
		if !ok || strings.Count(which, "\n") != 1 {
			t.Fatalf("explain's stderr %q, want one line saying which configuration decided", stderr)
		}
		which = strings.TrimSuffix(which, "\n")
		return rows[0][1] + " " + rows[0][6] + ", " + rows[1][1], which
	}

	lock, ctx := holdLock(t, "agent")
	got, which := verdict(t, ctx)
	if want := "MASQUERADE masqOutBound:, MASQUERADE"; got != want {
		t.Errorf("an agent that does not answer yet: %s, want the file's %s", got, want)
	}
	if !strings.HasPrefix(which, "file "+file+" (no running agent answered: the holder does not answer config: ip-masq-agent agent") {
		t.Errorf("an agent that does not answer yet: config: %s", which)
	}

	hash := agent.ConfigHash(cfg)
	lock.Answer(configQuery, func() (any, error) {
		return appliedConfig{Source: "ipmasqagentconfig default", SHA256: hash, Generation: 7, ResourceVersion: "4711",
			RandomFully: true, Config: cfg.Canonical()}, nil
	})
	got, which = verdict(t, ctx)
	if want := "MASQUERADE masqueradeCIDRs[0], RETURN"; got != want {
		t.Errorf("the running agent's configuration: %s, want %s", got, want)
	}
	if want := "applied by the running agent (source: ipmasqagentconfig default, generation 7, resourceVersion 4711, sha256 " + hash[:12] + ")"; which != want {
		t.Errorf("config: %s, want %s", which, want)
	}
	got, which = verdict(t, ctx, "--from-file")
	if want := "MASQUERADE masqOutBound:, MASQUERADE"; got != want || which != "file "+file+" (--from-file)" {
		t.Errorf("--from-file: %s, config: %s; want %s, the file", got, which, want)
	}

	// An agent that has applied nothing yet says so; nothing holding the lock is no agent.
	lock.Answer(configQuery, func() (any, error) { return nil, errString("no configuration applied yet") })
	if _, which = verdict(t, ctx); !strings.HasSuffix(which, ": no configuration applied yet)") {
		t.Errorf("an agent that applied nothing: config: %s", which)
	}
	lock.Release()
	if _, which = verdict(t, ctx); which != "file "+file+" (no running agent answered)" {
		t.Errorf("no agent: config: %s", which)
	}
}

type errString string

func (e errString) Error() string { return string(e) }
