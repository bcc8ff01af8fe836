package e2e

import (
	"bytes"
	"context"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// explainIn runs `explain ADDR...` in the node as an operator does beside the agent (kubectl
// exec): without the agent's flags, its --config a file that does not exist (the defaults). It
// returns each address's verdict and the CIDR of its rule ("RETURN 8.8.8.0/24"; "RETURN no"
// where no rule matched), and the line, on stderr, saying which configuration decided.
func explainIn(ctx context.Context, t *testing.T, env *Env, addrs ...string) (map[string]string, string) {
	t.Helper()
	stdout, stderr := inNode(ctx, t, env, append([]string{"explain", "--config=" + filepath.Join(t.TempDir(), "absent")}, addrs...)...)
	verdicts := map[string]string{}
	table, _, _ := strings.Cut(stdout, "\n\n")
	for _, l := range strings.Split(table, "\n")[1:] {
		if f := strings.Fields(l); len(f) >= 6 { // ADDRESS VERDICT SOURCE RULE (two fields) CIDR FROM
			verdicts[f[0]] = f[1] + " " + f[5]
		}
	}
	which, ok := strings.CutPrefix(stderr, "config: ")
	if !ok {
		t.Fatalf("explain does not say which configuration decided:\n%s%s", stdout, stderr)
	}
	return verdicts, strings.TrimSpace(which)
}

// inNode runs the agent's binary with args in the node and returns its stdout and stderr.
func inNode(ctx context.Context, t *testing.T, env *Env, args ...string) (string, string) {
	t.Helper()
	var stdout, stderr bytes.Buffer
	cmd := exec.CommandContext(ctx, "ip", append([]string{"netns", "exec", env.Node, env.Bin}, args...)...)
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("%s: %v\n%s%s", strings.Join(args, " "), err, stdout.String(), stderr.String())
	}
	return stdout.String(), stderr.String()
}

// TestExplainFollowsTheAgent: explain and dump, run in the node without the agent's flags, read
// the configuration the running agent applied (here a file the defaults differ from), follow its
// reload, and fall back to their own --config once no agent runs.
func TestExplainFollowsTheAgent(t *testing.T) {
	eachBackend(t, backends(), nil, func(ctx context.Context, t *testing.T, b Backend, env *Env) {
		const addrs = "8.8.8.8 10.1.2.3"
		a := env.StartReady(ctx, t, b, "nonMasqueradeCIDRs: [8.8.8.0/24]\n")
		got, which := explainIn(ctx, t, env, strings.Fields(addrs)...)
		if got["8.8.8.8"] != "RETURN 8.8.8.0/24" || got["10.1.2.3"] != "MASQUERADE 0.0.0.0/0" {
			t.Errorf("explain %s beside the agent: %v, want the agent's configuration's verdicts", addrs, got)
		}
		if want := "applied by the running agent (source: file " + env.Config.Path() + ", sha256 "; !strings.HasPrefix(which, want) {
			t.Errorf("config: %s, want it to start with %q", which, want)
		}

		// dump, without --config, names the rules by the agent's configuration too.
		out, stderr := inNode(ctx, t, env, env.DatapathArgs("dump", b)...)
		if !strings.Contains(out, "8.8.8.0/24") || !strings.Contains(out, "nonMasqueradeCIDRs[0]") ||
			!strings.HasPrefix(stderr, "config: applied by the running agent (source: file "+env.Config.Path()) {
			t.Errorf("dump beside the agent does not name its rules by the agent's configuration:\n%s%s", out, stderr)
		}

		// A reload: explain follows.
		applied := a.Count("policy applied")
		if err := env.Config.Write("nonMasqueradeCIDRs: [10.0.0.0/8]\nmasqOutBound: false\n"); err != nil {
			t.Fatal(err)
		}
		if err := a.WaitLog(ctx, applied+1, "policy applied"); err != nil {
			t.Fatal(err)
		}
		if got, _ := explainIn(ctx, t, env, strings.Fields(addrs)...); got["8.8.8.8"] != "RETURN no" || got["10.1.2.3"] != "RETURN 10.0.0.0/8" {
			t.Errorf("explain %s after the agent's reload: %v, want the new configuration's verdicts", addrs, got)
		}

		// No agent: the defaults of the absent --config, and explain says so.
		if err := a.Stop(ctx); err != nil {
			t.Fatal(err)
		}
		got, which = explainIn(ctx, t, env, strings.Fields(addrs)...)
		if got["8.8.8.8"] != "MASQUERADE 0.0.0.0/0" || got["10.1.2.3"] != "RETURN 10.0.0.0/8" {
			t.Errorf("explain %s with no agent: %v, want the defaults' verdicts", addrs, got)
		}
		if !strings.HasSuffix(which, "(no running agent answered)") {
			t.Errorf("config with no agent: %s", which)
		}
	})
}
