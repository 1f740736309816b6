# The admin's "Database locks" page: a model without a table, for its place in the admin
# and its view permission.

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("advisory_locks_django", "0001_initial")]

    operations = [
        migrations.CreateModel(
            name="DatabaseLock",
            fields=[
                (
                    "id",
                    models.AutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
            ],
            options={
                "verbose_name": "database lock",
                "verbose_name_plural": "database locks",
                "db_table": "advisory_locks_django_databaselock",
                "managed": False,
                "default_permissions": ("view",),
            },
        ),
    ]
