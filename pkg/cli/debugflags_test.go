package cli

import (
	"bytes"
	"context"
	"regexp"
	"strings"
	"testing"
)

// TestNoDebugFlags: the agent has no flag that turns on a debug or profiling endpoint (pprof,
// expvar, tracing), so none can be served; adding one should be a decision that updates this
// test and SECURITY.md together.
func TestNoDebugFlags(t *testing.T) {
	var stdout, stderr bytes.Buffer
	if err := Run(context.Background(), []string{"--help"}, &stdout, &stderr); err != nil {
		t.Fatalf("--help: %v", err)
	}
	names := regexp.MustCompile(`(?m)^\s+-{1,2}([a-z0-9-]+)`).FindAllStringSubmatch(stderr.String()+stdout.String(), -1)
	if len(names) < 10 {
		t.Fatalf("found %d flags in the usage:\n%s%s", len(names), stdout.String(), stderr.String())
	}
	for _, m := range names {
		for _, bad := range []string{"pprof", "debug", "profil", "trace", "expvar"} {
			if strings.Contains(m[1], bad) {
				t.Errorf("flag --%s looks like a debug endpoint switch", m[1])
			}
		}
	}
}
