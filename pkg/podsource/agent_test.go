package podsource_test

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/internal/cluster"
	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/agent"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/configwatch"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath/datapathtest"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/podsource"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// batchPods is the pods of the applied policy's source rule batch.
func batchPods(p *policy.Policy) string {
	for _, s := range p.Sources {
		if s.Name == "batch" {
			return fmt.Sprint(s.Pods)
		}
	}
	return "no rule batch"
}

// TestAgentAppliesPods runs the agent with the watcher against a real API server: the
// configuration waits for the first list, then a namespace's labels, changed back and forth,
// reach the applied policy; each time from the API write to the end of the apply is logged.
func TestAgentAppliesPods(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cp := cluster.StartControlPlane(t, cluster.Options{})
	p := pods{ctx: ctx, t: t, cp: cp}
	p.namespace("batch", map[string]string{"team": "batch"})
	p.namespace("web", map[string]string{"team": "web"})
	p.run("batch", "job", node, nil, false, "10.244.0.10")
	p.run("web", "front", node, nil, false, "10.244.0.11")

	path := filepath.Join(t.TempDir(), "ip-masq-agent")
	if err := os.WriteFile(path, []byte(`sourceRules:
- {name: batch, namespaceSelector: {matchLabels: {team: batch}}, masqOutBound: false}
`), 0o644); err != nil {
		t.Fatal(err)
	}
	logs := &testutil.Buffer{}
	log := slog.New(slog.NewTextHandler(logs, nil))
	src, err := configwatch.New(path, configwatch.Options{Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	w, err := podsource.New(cp.Config, podsource.Options{Node: node, Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	b := &datapathtest.Backend{}
	a, err := agent.New(agent.Options{Source: src, Backend: b, Pods: w, Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	start := time.Now()
	go func() { done <- a.Run(runCtx, nil) }()
	t.Cleanup(func() {
		stop()
		if err := <-done; err != nil {
			t.Error(err)
		}
		if t.Failed() {
			t.Logf("agent log:\n%s", logs)
		}
	})
	// Nothing is applied before the pods are known: the first apply holds them.
	if got := batchPods(b.WaitApply(t)); got != "[10.244.0.10]" {
		t.Fatalf("first apply: batch holds %s", got)
	}
	t.Logf("agent start -> first apply with the pods: %v", time.Since(start).Round(time.Microsecond))

	var took []time.Duration
	for i := range 6 {
		team, want := "batch", "[10.244.0.10 10.244.0.11]"
		if i%2 == 1 {
			team, want = "web", "[10.244.0.10]"
		}
		start := time.Now()
		p.patch("namespace", "", "web", `{"metadata":{"labels":{"team":"`+team+`"}}}`)
		for {
			if got := batchPods(b.WaitApply(t)); got == want {
				break
			}
		}
		took = append(took, time.Since(start))
	}
	slices.Sort(took)
	t.Logf("namespace label write -> policy applied, %d changes: min %v, median %v, max %v", len(took),
		took[0].Round(time.Microsecond), took[len(took)/2].Round(time.Microsecond), took[len(took)-1].Round(time.Microsecond))
	if s := a.Stats(); s.ConfigErrors != 0 || !s.Ready {
		t.Errorf("stats %+v; want ready without rejections", s)
	}
}
