package cluster

import (
	"context"
	"fmt"
	"io"
	"log"
	"path/filepath"
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/internal/cluster"
	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"helm.sh/helm/v3/pkg/action"
	"helm.sh/helm/v3/pkg/chart"
	"helm.sh/helm/v3/pkg/chart/loader"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/cli-runtime/pkg/genericclioptions"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/kyaml/filesys"
)

// Namespace is where the chart and the kustomize base install the agent.
const Namespace = "kube-system"

// Release is the Helm release's name; the DaemonSets are named after it.
const Release = "ip-masq-agent"

// deployTimeout bounds an install, an uninstall or a rollout: a liveness bound.
const deployTimeout = 3 * time.Minute

// helmConfig is a Helm action configuration talking to the cluster's API server as its admin.
func helmConfig(t testing.TB, c *cluster.Cluster) *action.Configuration {
	t.Helper()
	flags := genericclioptions.NewConfigFlags(false)
	kc, ns := c.Kubeconfig, Namespace
	flags.KubeConfig, flags.Namespace = &kc, &ns
	flags.WrapConfigFn = func(cfg *rest.Config) *rest.Config {
		cfg.Dial = c.Config.Dial
		return cfg
	}
	cfg := new(action.Configuration)
	if err := cfg.Init(flags, Namespace, "secret", func(format string, v ...any) { t.Logf("helm: "+format, v...) }); err != nil {
		t.Fatal(err)
	}
	return cfg
}

// loadChart loads the repository's chart.
func loadChart(t testing.TB) *chart.Chart {
	t.Helper()
	root, err := cluster.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	return loadChartAt(t, root)
}

// loadChartAt loads the chart of the tree at root, as helm does (its loader's notice about the
// dashboard's symbolic link kept out of the test's output).
func loadChartAt(t testing.TB, root string) *chart.Chart {
	t.Helper()
	out := log.Writer()
	log.SetOutput(io.Discard)
	defer log.SetOutput(out)
	ch, err := loader.Load(filepath.Join(root, "deploy", "helm", "ip-masq-agent"))
	if err != nil {
		t.Fatal(err)
	}
	return ch
}

// helmInstall installs (or upgrades) this tree's chart with values, as `helm upgrade
// --install` does.
func helmInstall(t testing.TB, c *cluster.Cluster, values map[string]any) {
	t.Helper()
	helmInstallChart(t, c, loadChart(t), values)
}

// helmInstallChart is helmInstall with a chart of another release.
func helmInstallChart(t testing.TB, c *cluster.Cluster, ch *chart.Chart, values map[string]any) {
	t.Helper()
	cfg := helmConfig(t, c)
	hist := action.NewHistory(cfg)
	hist.Max = 1
	if _, err := hist.Run(Release); err == nil {
		up := action.NewUpgrade(cfg)
		up.Namespace, up.Timeout = Namespace, deployTimeout
		if _, err := up.Run(Release, ch, values); err != nil {
			t.Fatalf("helm upgrade: %v", err)
		}
		return
	}
	install := action.NewInstall(cfg)
	install.ReleaseName, install.Namespace, install.Timeout = Release, Namespace, deployTimeout
	if _, err := install.Run(ch, values); err != nil {
		t.Fatalf("helm install: %v", err)
	}
}

// helmRollback rolls the release back to a revision, as `helm rollback RELEASE REVISION`
// does.
func helmRollback(t testing.TB, c *cluster.Cluster, revision int) {
	t.Helper()
	rb := action.NewRollback(helmConfig(t, c))
	rb.Timeout, rb.Version = deployTimeout, revision
	if err := rb.Run(Release); err != nil {
		t.Fatalf("helm rollback: %v", err)
	}
}

// helmUninstall uninstalls the release; its post-delete hook starts the cleanup DaemonSet.
func helmUninstall(t testing.TB, c *cluster.Cluster) {
	t.Helper()
	un := action.NewUninstall(helmConfig(t, c))
	un.Timeout = deployTimeout
	if _, err := un.Run(Release); err != nil {
		t.Fatalf("helm uninstall: %v", err)
	}
}

// kustomizeApply builds a kustomization of the repository (deploy/...) with kustomize's library
// (what kubectl apply -k runs) and applies every object server-side.
func kustomizeApply(ctx context.Context, t testing.TB, c *cluster.Cluster, dir string) []*unstructured.Unstructured {
	t.Helper()
	root, err := cluster.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	res, err := krusty.MakeKustomizer(krusty.MakeDefaultOptions()).Run(filesys.MakeFsOnDisk(), filepath.Join(root, dir))
	if err != nil {
		t.Fatal(err)
	}
	dyn := dynamic.NewForConfigOrDie(c.Config)
	var objs []*unstructured.Unstructured
	for _, r := range res.Resources() {
		m, err := r.Map()
		if err != nil {
			t.Fatal(err)
		}
		u := &unstructured.Unstructured{Object: m}
		data, err := u.MarshalJSON()
		if err != nil {
			t.Fatal(err)
		}
		force := true
		if _, err := dyn.Resource(gvr(u)).Namespace(u.GetNamespace()).Patch(ctx, u.GetName(), types.ApplyPatchType, data,
			metav1.PatchOptions{FieldManager: "cluster-test", Force: &force}); err != nil {
			t.Fatalf("apply %s %s: %v", u.GetKind(), u.GetName(), err)
		}
		objs = append(objs, u)
	}
	return objs
}

// kustomizeDelete deletes what kustomizeApply applied.
func kustomizeDelete(ctx context.Context, t testing.TB, c *cluster.Cluster, objs []*unstructured.Unstructured) {
	t.Helper()
	dyn := dynamic.NewForConfigOrDie(c.Config)
	for _, u := range objs {
		if err := dyn.Resource(gvr(u)).Namespace(u.GetNamespace()).Delete(ctx, u.GetName(), metav1.DeleteOptions{}); err != nil {
			t.Errorf("delete %s %s: %v", u.GetKind(), u.GetName(), err)
		}
	}
}

// gvr maps the kinds the manifests hold to their resources.
func gvr(u *unstructured.Unstructured) schema.GroupVersionResource {
	gv := u.GroupVersionKind().GroupVersion()
	resources := map[string]string{"ConfigMap": "configmaps", "DaemonSet": "daemonsets", "Service": "services",
		"ServiceAccount": "serviceaccounts", "Role": "roles", "RoleBinding": "rolebindings",
		"ClusterRole": "clusterroles", "ClusterRoleBinding": "clusterrolebindings",
		"CustomResourceDefinition": "customresourcedefinitions", "ValidatingAdmissionPolicy": "validatingadmissionpolicies",
		"ValidatingAdmissionPolicyBinding": "validatingadmissionpolicybindings"}
	return gv.WithResource(resources[u.GetKind()])
}

// waitDaemonSet waits until the DaemonSet's pods on every node are updated, available and
// ready, and returns node 1's.
func waitDaemonSet(ctx context.Context, t testing.TB, c *cluster.Cluster, name string) *corev1.Pod {
	t.Helper()
	var pod *corev1.Pod
	wait(ctx, t, "DaemonSet "+name+" ready", func() error {
		ds, err := c.Client.AppsV1().DaemonSets(Namespace).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		st := ds.Status
		n := int32(len(c.Nodes))
		if ds.Generation != st.ObservedGeneration || st.DesiredNumberScheduled != n || st.UpdatedNumberScheduled != n ||
			st.NumberReady != n || st.NumberAvailable != n || st.NumberUnavailable != 0 {
			return fmt.Errorf("status %+v", st)
		}
		p, err := dsPod(ctx, c, ds)
		if err != nil {
			return err
		}
		pod = p
		return nil
	})
	return pod
}

// dsPod is the DaemonSet's one running pod on node 1.
func dsPod(ctx context.Context, c *cluster.Cluster, ds *appsv1.DaemonSet) (*corev1.Pod, error) {
	sel, err := metav1.LabelSelectorAsSelector(ds.Spec.Selector)
	if err != nil {
		return nil, err
	}
	pods, err := c.Client.CoreV1().Pods(Namespace).List(ctx, metav1.ListOptions{LabelSelector: sel.String()})
	if err != nil {
		return nil, err
	}
	var found []*corev1.Pod
	for i := range pods.Items {
		if p := &pods.Items[i]; p.DeletionTimestamp == nil && p.Status.Phase == corev1.PodRunning && p.Spec.NodeName == c.Nodes[0].Name {
			found = append(found, p)
		}
	}
	if len(found) != 1 {
		return nil, fmt.Errorf("%d running pods of %s", len(found), ds.Name)
	}
	return found[0], nil
}

// waitGone waits until no pod matches the label selector in Namespace.
func waitNoPods(ctx context.Context, t testing.TB, c *cluster.Cluster, selector string) {
	t.Helper()
	wait(ctx, t, "no pod "+selector, func() error {
		pods, err := c.Client.CoreV1().Pods(Namespace).List(ctx, metav1.ListOptions{LabelSelector: selector})
		if err != nil {
			return err
		}
		if len(pods.Items) > 0 {
			return fmt.Errorf("%d pods left", len(pods.Items))
		}
		return nil
	})
}

// podLogs is a container's log, read through the API server (and so the kubelet).
func podLogs(ctx context.Context, t testing.TB, c *cluster.Cluster, pod *corev1.Pod, container string) string {
	t.Helper()
	b, err := c.Client.CoreV1().Pods(pod.Namespace).GetLogs(pod.Name, &corev1.PodLogOptions{Container: container}).DoRaw(ctx)
	if err != nil {
		t.Fatalf("logs of %s: %v", pod.Name, err)
	}
	return string(b)
}

// wait polls cond every 250 ms until it succeeds, failing the test after deployTimeout.
func wait(ctx context.Context, t testing.TB, what string, cond func() error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, deployTimeout)
	defer cancel()
	if err := testutil.PollContext(ctx, 250*time.Millisecond, func() error {
		if err := cond(); err != nil {
			return testutil.NotYet("%v", err)
		}
		return nil
	}); err != nil {
		t.Fatalf("%s: not within %v: %v", what, deployTimeout, err)
	}
}
