package apisource_test

import (
	"context"
	"encoding/json"
	"errors"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/rollout"
	"k8s.io/apimachinery/pkg/types"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/dynamic"

	"github.com/ip-masq-agent/ip-masq-agent/internal/cluster"
	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/apisource"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/kube"
)

// wait bounds each wait for a change: a watch event arrives in milliseconds; the bound is for
// the API server's restart and the informer's backoff after it.
const wait = 60 * time.Second

// watching is a source being watched, with its log.
type watching struct {
	*apisource.Source
	changes <-chan struct{}
	log     *testutil.Buffer
}

func watch(ctx context.Context, t *testing.T, cp *cluster.ControlPlane, kubeconfig string, obj apisource.Object) *watching {
	t.Helper()
	return watchAs(ctx, t, cp, kubeconfig, obj, "")
}

// watchAs is watch for the agent of the node named node.
func watchAs(ctx context.Context, t *testing.T, cp *cluster.ControlPlane, kubeconfig string, obj apisource.Object, node string) *watching {
	t.Helper()
	cfg, err := cp.RESTConfig(kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	l := &testutil.Buffer{}
	src, err := apisource.New(cfg, obj, apisource.Options{Node: node, Logger: slog.New(slog.NewTextHandler(l, nil))})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(ctx)
	changes, err := src.Watch(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cancel()
		for range changes { // closed once the informer stopped
		}
		if t.Failed() {
			t.Logf("source log:\n%s", l)
		}
	})
	return &watching{Source: src, changes: changes, log: l}
}

// next waits for the source's next change report, and loads.
func (w *watching) next(t *testing.T, what string) (config.Config, error) {
	t.Helper()
	select {
	case _, ok := <-w.changes:
		if !ok {
			t.Fatalf("%s: the source stopped", what)
		}
	case <-time.After(wait):
		t.Fatalf("%s: no change reported in %v", what, wait)
	}
	return w.Load()
}

// quiet takes the change reports already made, until none comes for a second.
func (w *watching) quiet(t *testing.T) {
	t.Helper()
	for {
		select {
		case _, ok := <-w.changes:
			if !ok {
				t.Fatal("the source stopped")
			}
		case <-time.After(time.Second):
			return
		}
	}
}

// until loads at each change report until cond holds of what Load returns.
func (w *watching) until(t *testing.T, what string, cond func(config.Config, error) bool) config.Config {
	t.Helper()
	var cfg config.Config
	if err := testutil.Poll(wait, 0, func() error {
		var err error
		if cfg, err = w.next(t, what); !cond(cfg, err) {
			return testutil.NotYet("%s (last: %s, %v)", what, nonMasq(cfg), err)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	return cfg
}

func nonMasq(cfg config.Config) string {
	var s []string
	for _, p := range cfg.NonMasqueradeCIDRs {
		s = append(s, p.String())
	}
	return strings.Join(s, ",")
}

// The sources against a real API server: a ConfigMap and an IPMasqAgentConfig followed through
// their changes, deletion and a bad document; an agent without permission told which it lacks;
// the API server stopped and started under a source, which keeps what it read and says so.
func TestSources(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cp := cluster.StartControlPlane(t, cluster.Options{})
	cms := cp.Client.CoreV1().ConfigMaps("kube-system")
	cmObj := apisource.Object{Kind: apisource.KindConfigMap, Namespace: "kube-system", Name: kube.DefaultConfigMapName}

	t.Run("configmap", func(t *testing.T) {
		src := watch(ctx, t, cp, cp.Kubeconfig, cmObj)
		if cfg, err := src.next(t, "the first list"); err != nil || nonMasq(cfg) != nonMasq(config.Default(config.Options{})) {
			t.Fatalf("no ConfigMap: %v, %v; want the defaults", nonMasq(cfg), err)
		}
		cm, err := cms.Create(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: cmObj.Name},
			Data: map[string]string{kube.ConfigMapKey: "nonMasqueradeCIDRs: [10.0.0.0/8]\n"}}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		src.until(t, "the ConfigMap's creation", func(cfg config.Config, err error) bool { return err == nil && nonMasq(cfg) == "10.0.0.0/8" })
		if rev := src.Revision(); rev.ResourceVersion != cm.ResourceVersion || rev.Generation != 0 {
			t.Errorf("revision %+v, the ConfigMap's is %s", rev, cm.ResourceVersion)
		}
		cm.Data[kube.ConfigMapKey] = "nonMasqueradeCIDRs: [10.0.0.1/8]\n"
		if _, err := cms.Update(ctx, cm, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
		src.until(t, "the bad document", func(_ config.Config, err error) bool {
			return err != nil && strings.Contains(err.Error(), `configmap kube-system/ip-masq-agent: nonMasqueradeCIDRs[0]: "10.0.0.1/8": host bits are set`)
		})
		bad := src.Revision()
		if err := cms.Delete(ctx, cmObj.Name, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
		deleted(t, src, bad)
		// An object without the key is how an operator asks for the defaults.
		if _, err := cms.Create(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: cmObj.Name}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		src.until(t, "a ConfigMap without the key", func(cfg config.Config, err error) bool {
			return err == nil && nonMasq(cfg) == nonMasq(config.Default(config.Options{}))
		})
		if src.Deleted() {
			t.Error("Deleted after the object's return")
		}
		if err := cms.Delete(ctx, cmObj.Name, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("crd", func(t *testing.T) {
		applyCRDs(ctx, t, cp)
		res := dynamic.NewForConfigOrDie(cp.Config).Resource(kube.Configs.GVR())
		obj := &unstructured.Unstructured{Object: map[string]any{"apiVersion": kube.Configs.APIVersion(), "kind": kube.Configs.Kind,
			"metadata": map[string]any{"name": "one"}, "spec": map[string]any{"nonMasqueradeCIDRs": []any{"172.16.0.0/12"}, "masqOutBound": false}}}
		if _, err := res.Create(ctx, obj, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		src := watch(ctx, t, cp, cp.Kubeconfig, apisource.Object{Kind: apisource.KindConfig, Name: "one"})
		cfg := src.until(t, "the first list", func(cfg config.Config, err error) bool { return err == nil })
		if nonMasq(cfg) != "172.16.0.0/12" || cfg.MasqOutBound {
			t.Errorf("read %s, masqOutBound %v", nonMasq(cfg), cfg.MasqOutBound)
		}
		got, err := res.Get(ctx, "one", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if err := unstructured.SetNestedStringSlice(got.Object, []string{"192.168.0.0/16"}, "spec", "nonMasqueradeCIDRs"); err != nil {
			t.Fatal(err)
		}
		if _, err := res.Update(ctx, got, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
		src.until(t, "the edit", func(cfg config.Config, err error) bool { return err == nil && nonMasq(cfg) == "192.168.0.0/16" })
		rev := src.Revision()
		if rev.Generation != 2 {
			t.Errorf("revision %+v after one edit, want generation 2", rev)
		}

		// Labels and annotations are not the configuration: no change, the same revision.
		src.quiet(t)
		got, err = res.Get(ctx, "one", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		got.SetLabels(map[string]string{"team": "net"})
		got.SetAnnotations(map[string]string{"note": "metadata only"})
		edited, err := res.Update(ctx, got, metav1.UpdateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if edited.GetResourceVersion() == rev.ResourceVersion || edited.GetGeneration() != rev.Generation {
			t.Fatalf("the metadata edit: resourceVersion %s, generation %d (before: %+v)", edited.GetResourceVersion(), edited.GetGeneration(), rev)
		}
		select {
		case <-src.changes:
			t.Error("a metadata-only edit reported as a change")
		case <-time.After(2 * time.Second):
		}
		if cfg, err := src.Load(); err != nil || nonMasq(cfg) != "192.168.0.0/16" || src.Revision() != rev {
			t.Errorf("after the metadata edit: %s, %v, revision %+v; want the same configuration and revision %+v", nonMasq(cfg), err, src.Revision(), rev)
		}

		if err := res.Delete(ctx, "one", metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
		deleted(t, src, rev)
		// An empty spec is how an operator asks for the defaults.
		obj.SetResourceVersion("")
		obj.Object["spec"] = map[string]any{}
		if _, err := res.Create(ctx, obj, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		src.until(t, "an empty spec", func(cfg config.Config, err error) bool {
			return err == nil && nonMasq(cfg) == nonMasq(config.Default(config.Options{})) && cfg.MasqOutBound
		})
		if src.Deleted() || !strings.Contains(src.log.String(), "the configuration's object exists again") {
			t.Errorf("Deleted %v after the object's return", src.Deleted())
		}
	})

	// A rollout in the object's status: the node applies the stable spec until the rollout of
	// the object's generation releases it; a status write that changes nothing for the node is
	// no change.
	t.Run("rollout", func(t *testing.T) {
		applyCRDs(ctx, t, cp)
		res := dynamic.NewForConfigOrDie(cp.Config).Resource(kube.Configs.GVR())
		specA := map[string]any{"nonMasqueradeCIDRs": []any{"10.0.0.0/8"}}
		obj := &unstructured.Unstructured{Object: map[string]any{"apiVersion": kube.Configs.APIVersion(), "kind": kube.Configs.Kind,
			"metadata": map[string]any{"name": "waves"}, "spec": specA}}
		obj, err := res.Create(ctx, obj, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		src := watchAs(ctx, t, cp, cp.Kubeconfig, apisource.Object{Kind: apisource.KindConfig, Name: "waves"}, "node-x")
		src.until(t, "the first list", func(cfg config.Config, err error) bool { return err == nil && nonMasq(cfg) == "10.0.0.0/8" })
		src.quiet(t)
		setRollout := func(r kube.Rollout) {
			t.Helper()
			o, err := res.Get(ctx, "waves", metav1.GetOptions{})
			if err != nil {
				t.Fatal(err)
			}
			raw, _ := json.Marshal(kube.ConfigObjectStatus{Rollout: &r})
			var st map[string]any
			_ = json.Unmarshal(raw, &st)
			o.Object["status"] = st
			if _, err := res.UpdateStatus(ctx, o, metav1.UpdateOptions{}); err != nil {
				t.Fatal(err)
			}
		}
		stableA := &kube.StableConfig{Generation: 1, Spec: json.RawMessage(`{"nonMasqueradeCIDRs":["10.0.0.0/8"]}`)}
		setRollout(kube.Rollout{Generation: 1, Phase: kube.RolloutComplete, ReleasedBelow: kube.AllNodes, Stable: stableA})
		select {
		case <-src.changes:
			t.Error("a rollout status that changes nothing for the node reported as a change")
		case <-time.After(2 * time.Second):
		}
		// A new generation the controller has not released to this node: the stable spec stays.
		if _, err := res.Patch(ctx, "waves", types.MergePatchType, []byte(`{"spec":{"nonMasqueradeCIDRs":["192.168.0.0/16"]}}`), metav1.PatchOptions{}); err != nil {
			t.Fatal(err)
		}
		src.quiet(t)
		if cfg, err := src.Load(); err != nil || nonMasq(cfg) != "10.0.0.0/8" || src.Revision().Generation != 1 {
			t.Errorf("before its wave: %s, %v, revision %+v; want the stable spec of generation 1", nonMasq(cfg), err, src.Revision())
		}
		if !strings.Contains(src.log.String(), "rolled out in waves; this node keeps the stable one until its wave") {
			t.Error("the wait for the wave is not logged")
		}
		setRollout(kube.Rollout{Generation: 2, Phase: kube.RolloutProgressing, ReleasedBelow: rollout.NodeHash("node-x"), Stable: stableA})
		src.quiet(t)
		if cfg, err := src.Load(); err != nil || nonMasq(cfg) != "10.0.0.0/8" {
			t.Errorf("a wave of the nodes below it: %s, %v", nonMasq(cfg), err)
		}
		setRollout(kube.Rollout{Generation: 2, Phase: kube.RolloutProgressing, ReleasedBelow: rollout.NodeHash("node-x") + 1, Stable: stableA})
		src.until(t, "its wave", func(cfg config.Config, err error) bool { return err == nil && nonMasq(cfg) == "192.168.0.0/16" })
		if g := src.Revision().Generation; g != 2 {
			t.Errorf("in its wave: generation %d, want 2", g)
		}
	})

	t.Run("no permission", func(t *testing.T) {
		nobody, err := cp.UserKubeconfig("nobody")
		if err != nil {
			t.Fatal(err)
		}
		src := watch(ctx, t, cp, nobody, cmObj)
		_, err = src.next(t, "the refusal")
		for i := 0; i < 5 && err == nil; i++ {
			_, err = src.next(t, "the refusal")
		}
		if !errors.Is(err, config.ErrUnavailable) || !strings.Contains(err.Error(), "forbidden") ||
			!strings.Contains(err.Error(), `needs get, list and watch on configmaps "ip-masq-agent" in the namespace kube-system`) {
			t.Errorf("Load: %v; want no configuration, naming the permission", err)
		}
		if n := strings.Count(src.log.String(), "cannot read the configuration from the API server"); n != 1 || !strings.Contains(src.log.String(), "need=") {
			t.Errorf("%d lines about the refusal, want 1 saying what is needed", n)
		}
	})

	t.Run("API server lost", func(t *testing.T) {
		if _, err := cms.Create(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: cmObj.Name},
			Data: map[string]string{kube.ConfigMapKey: "nonMasqueradeCIDRs: [10.0.0.0/8]\n"}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		src := watch(ctx, t, cp, cp.Kubeconfig, cmObj)
		src.until(t, "the first list", func(cfg config.Config, err error) bool { return err == nil && nonMasq(cfg) == "10.0.0.0/8" })
		if err := cp.StopAPIServer(); err != nil {
			t.Fatal(err)
		}
		src.until(t, "the loss", func(config.Config, error) bool { return src.Unreachable() != nil })
		if cfg, err := src.Load(); err != nil || nonMasq(cfg) != "10.0.0.0/8" {
			t.Errorf("while the API server is gone: %s, %v; want what it read", nonMasq(cfg), err)
		}
		if err := cp.StartAPIServer(ctx); err != nil {
			t.Fatal(err)
		}
		src.until(t, "the return", func(config.Config, error) bool { return src.Unreachable() == nil })
		cm, err := cms.Get(ctx, cmObj.Name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		cm.Data[kube.ConfigMapKey] = "nonMasqueradeCIDRs: [100.64.0.0/10]\n"
		if _, err := cms.Update(ctx, cm, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
		src.until(t, "an edit after the return", func(cfg config.Config, err error) bool { return err == nil && nonMasq(cfg) == "100.64.0.0/10" })
		l := src.log.String()
		if n := strings.Count(l, "cannot read the configuration from the API server; the configuration in force stays"); n != 1 {
			t.Errorf("%d lines about the loss, want 1", n)
		}
		if n := strings.Count(l, "the API server answers again"); n != 1 {
			t.Errorf("%d lines about the return, want 1", n)
		}
	})
}

// deleted checks a source whose object was just deleted: nothing to load (the configuration in
// force stays, of revision rev), Deleted, and one warning saying what the deletion does not do.
func deleted(t *testing.T, src *watching, rev config.Revision) {
	t.Helper()
	src.until(t, "the deletion", func(_ config.Config, err error) bool { return err != nil })
	if _, err := src.Load(); !errors.Is(err, config.ErrUnavailable) || !strings.Contains(err.Error(), "deleted") {
		t.Errorf("Load after the deletion: %v; want config.ErrUnavailable saying why", err)
	}
	if !src.Deleted() || src.Unreachable() != nil || src.Revision() != rev {
		t.Errorf("Deleted %v, Unreachable %v, revision %+v; want deleted, reachable, revision %+v", src.Deleted(), src.Unreachable(), src.Revision(), rev)
	}
	l := src.log.String()
	if n := strings.Count(l, "level=WARN msg=\"the configuration's object was deleted; the configuration in force stays"); n != 1 {
		t.Errorf("%d warnings about the deletion, want 1:\n%s", n, l)
	}
}

// applyCRDs installs the project's CRDs (deploy/crds) and waits until they serve.
func applyCRDs(ctx context.Context, t *testing.T, cp *cluster.ControlPlane) {
	t.Helper()
	root, err := cluster.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(root, "deploy", "crds")
	if _, err := os.Stat(dir); err != nil {
		t.Fatal(err)
	}
	if out, err := cp.Kubectl(ctx, "apply", "-f", filepath.Join(dir, "ipmasqagentconfigs.yaml"), "-f", filepath.Join(dir, "ipmasqagentnodes.yaml")); err != nil {
		t.Fatalf("kubectl apply: %v\n%s", err, out)
	}
	if out, err := cp.Kubectl(ctx, "wait", "--for=condition=Established", "--timeout=60s", "crd/"+kube.Configs.CRDName(), "crd/"+kube.Nodes.CRDName()); err != nil {
		t.Fatalf("kubectl wait: %v\n%s", err, out)
	}
}
