package cluster_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/internal/cluster"
	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"
)

// TestControlPlane starts etcd and the API server, writes and watches a ConfigMap through the
// client, restarts the API server under the watch (the object survives, a new watch sees the
// next edit), reaches the API server from an attached namespace with kubectl, and shows that a
// user without bindings is refused.
func TestControlPlane(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	start := time.Now()
	cp := cluster.StartControlPlane(t, cluster.Options{})
	t.Logf("control plane ready in %v", time.Since(start).Round(time.Millisecond))

	cms := cp.Client.CoreV1().ConfigMaps("default")
	cm, err := cms.Create(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "ip-masq-agent"},
		Data: map[string]string{"config": "masqOutBound: true\n"}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	w, err := cms.Watch(ctx, metav1.ListOptions{FieldSelector: "metadata.name=ip-masq-agent", ResourceVersion: cm.ResourceVersion})
	if err != nil {
		t.Fatal(err)
	}
	cm.Data["config"] = "masqOutBound: false\n"
	if _, err := cms.Update(ctx, cm, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	waitEvent(ctx, t, w, "masqOutBound: false\n")

	start = time.Now()
	if err := cp.RestartAPIServer(ctx); err != nil {
		t.Fatal(err)
	}
	t.Logf("API server restarted in %v", time.Since(start).Round(time.Millisecond))
	// The watch ends with the server; the object is still in etcd.
	for range w.ResultChan() {
	}
	got, err := cms.Get(ctx, "ip-masq-agent", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if got.Data["config"] != "masqOutBound: false\n" {
		t.Fatalf("after the restart the ConfigMap says %q", got.Data["config"])
	}

	// A namespace of the test's reaches the API server once attached.
	node := testutil.NewNetns(t)
	src := cp.AttachT(t, node)
	out, err := cluster.Namespaces{Net: "/run/netns/" + node}.Run(ctx, time.Minute,
		cp.Bin+"/kubectl", "--kubeconfig="+cp.Kubeconfig, "get", "configmap", "ip-masq-agent", "-o", "jsonpath={.data.config}")
	if err != nil {
		t.Fatal(err)
	}
	if out != "masqOutBound: false\n" {
		t.Fatalf("kubectl in the attached namespace (%s) read %q", src, out)
	}

	// A user with no bindings is authenticated and refused, with the permission named.
	kc, err := cp.UserKubeconfig("nobody")
	if err != nil {
		t.Fatal(err)
	}
	out, err = cp.Kubectl(ctx, "--kubeconfig="+kc, "get", "configmaps")
	if err == nil || !strings.Contains(out, `User "nobody" cannot list resource "configmaps"`) {
		t.Fatalf("kubectl as a user without bindings: %v: %s", err, out)
	}
	cfg, err := cp.RESTConfig(kc)
	if err != nil {
		t.Fatal(err)
	}
	nobody, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := nobody.CoreV1().ConfigMaps("default").Get(ctx, "ip-masq-agent", metav1.GetOptions{}); !apierrors.IsForbidden(err) {
		t.Fatalf("get as a user without bindings: %v, want forbidden", err)
	}
}

func waitEvent(ctx context.Context, t *testing.T, w watch.Interface, want string) {
	t.Helper()
	for {
		select {
		case ev, ok := <-w.ResultChan():
			if !ok {
				t.Fatal("the watch ended")
			}
			if cm, ok := ev.Object.(*corev1.ConfigMap); ok && ev.Type == watch.Modified && cm.Data["config"] == want {
				return
			}
		case <-ctx.Done():
			t.Fatalf("no watch event with %q", want)
		}
	}
}
