package fleet

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"sigs.k8s.io/yaml"

	"github.com/ip-masq-agent/ip-masq-agent/internal/cluster"
	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/kube"
)

// deployPath is a path under the repository's deploy/.
func deployPath(t *testing.T, path string) string {
	t.Helper()
	root, err := cluster.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	return filepath.Join(root, "deploy", path)
}

// kubectl runs kubectl as the admin, failing the test on an error.
func kubectl(ctx context.Context, t *testing.T, cp *cluster.ControlPlane, args ...string) string {
	t.Helper()
	out, err := cp.Kubectl(ctx, args...)
	if err != nil {
		t.Fatalf("kubectl %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return out
}

// applyCRDs installs deploy/crds and waits until the API server serves them.
func applyCRDs(ctx context.Context, t *testing.T, cp *cluster.ControlPlane) {
	t.Helper()
	kubectl(ctx, t, cp, "apply", "-f", deployPath(t, "crds/ipmasqagentconfigs.yaml"), "-f", deployPath(t, "crds/ipmasqagentnodes.yaml"))
	kubectl(ctx, t, cp, "wait", "--for=condition=Established", "--timeout=60s", "crd/"+kube.Configs.CRDName(), "crd/"+kube.Nodes.CRDName())
}

// applyEdited applies the manifests of a deploy/ file with edit run on each object first (to
// place them in a test's namespace), and returns them.
func applyEdited(ctx context.Context, t *testing.T, cp *cluster.ControlPlane, path string, edit func(map[string]any)) []map[string]any {
	t.Helper()
	data, err := os.ReadFile(deployPath(t, path))
	if err != nil {
		t.Fatal(err)
	}
	var objs []map[string]any
	var out []string
	for _, doc := range strings.Split(string(data), "\n---\n") {
		var o map[string]any
		if err := yaml.Unmarshal([]byte(doc), &o); err != nil {
			t.Fatal(err)
		}
		if edit != nil {
			edit(o)
		}
		y, err := yaml.Marshal(o)
		if err != nil {
			t.Fatal(err)
		}
		objs, out = append(objs, o), append(out, string(y))
	}
	file := filepath.Join(t.TempDir(), filepath.Base(path))
	if err := os.WriteFile(file, []byte(strings.Join(out, "---\n")), 0o644); err != nil {
		t.Fatal(err)
	}
	kubectl(ctx, t, cp, "apply", "-f", file)
	return objs
}

// eventually polls cond every 20ms until it holds, failing the test after a liveness bound.
func eventually(t *testing.T, what string, bound time.Duration, cond func() bool) {
	t.Helper()
	if err := testutil.Poll(bound, 20*time.Millisecond, func() error {
		if !cond() {
			return testutil.NotYet("%s", what)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
}
